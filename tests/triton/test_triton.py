"""tiered_progcache.triton: Triton's cache manager on the shared tiers, driven through Triton's own ``get_cache_manager``.

The group is a real kernel's (``triton.compile`` on the CPU, Triton's bundled ptxas);
the keys are the hashes Triton itself computes. Nodes are separate ``TRITON_CACHE_DIR``
directories (and, where it matters, separate processes) on one remote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

triton = pytest.importorskip("triton", exc_type=ImportError)  # absent, or present and broken

from triton.runtime.cache import FileCacheManager, get_cache_manager  # noqa: E402

import triton_support  # noqa: E402
from tiered_progcache import EntryRejected  # noqa: E402
from tiered_progcache import triton as tpt  # noqa: E402
from tiered_progcache.stores.breaker import CircuitBreaker  # noqa: E402
from tiered_progcache.config import CacheConfig  # noqa: E402
from tiered_progcache.stores.remote import RemoteProgramCache  # noqa: E402
from tiered_progcache.stores.store import entry_name  # noqa: E402
from tiered_progcache.testing.delayproxy import DelayProxy  # noqa: E402
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: E402, F401
from tiered_progcache.chain.tiered import TieredProgramCache  # noqa: E402
from support import FakeClock  # noqa: E402

MANAGER = "tiered_progcache.triton:TieredCacheManager"
SUPPORT = Path(__file__).parents[1] / "triton_support.py"
META = triton_support.METADATA_FILE


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[str, dict[str, bytes]]:
    """(Triton's kernel hash, file -> bytes) of a real compile, made once with Triton's own FileCacheManager."""
    directory = tmp_path_factory.mktemp("triton-compile")
    saved = os.environ.get("TRITON_CACHE_DIR"), os.environ.pop("TRITON_CACHE_MANAGER", None)
    os.environ["TRITON_CACHE_DIR"] = str(directory)
    try:
        kernel = triton_support.compile_kernel()
    finally:
        if saved[0] is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved[0]
        if saved[1] is not None:
            os.environ["TRITON_CACHE_MANAGER"] = saved[1]
    key_dir = directory / tpt_key(kernel.hash)
    files = {p.name: p.read_bytes() for p in key_dir.iterdir() if not p.name.startswith("__grp__")}
    assert {META, "add_kernel.cubin", "add_kernel.ptx"} <= set(files)
    return kernel.hash, files


def tpt_key(kernel_hash: str) -> str:
    """The key directory Triton names for a kernel hash (``get_cache_manager``'s base32)."""
    from triton.runtime.cache import _base32

    return _base32(kernel_hash)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Switch this process to node ``name``: its own TRITON_CACHE_DIR, our manager selected the way Triton selects one."""
    monkeypatch.setenv("TRITON_CACHE_MANAGER", MANAGER)

    def switch(name: str) -> Path:
        directory = tmp_path / name
        monkeypatch.setenv("TRITON_CACHE_DIR", str(directory))
        return directory

    yield switch
    chain = tpt._shared.if_built()
    tpt._reset_for_tests()
    if chain is not None:
        chain.close()


def _use(chain: TieredProgramCache) -> TieredProgramCache:
    tpt._reset_for_tests()
    tpt.use_shared_cache(chain)
    return chain


def _file_chain(url: str, **settings: Any) -> TieredProgramCache:
    chain = CacheConfig(remote=url, strict=True, **settings).build_shared(namespace=tpt.NAMESPACE)
    assert chain is not None
    return chain


def put_group(kernel_hash: str, files: dict[str, bytes]) -> dict[str, str]:
    """What ``triton.compile`` does after compiling: put each file, then the group (metadata last)."""
    manager = get_cache_manager(kernel_hash)
    assert isinstance(manager, tpt.TieredCacheManager)
    group = {name: manager.put(data, name, binary=name != META) for name, data in files.items() if name != META}
    group[META] = manager.put(files[META].decode(), META, binary=False)
    manager.put_group(META, group)
    return group


def _local_files(directory: Path, kernel_hash: str) -> dict[str, bytes]:
    key_dir = directory / tpt_key(kernel_hash)
    if not key_dir.exists():
        return {}
    return {p.name: p.read_bytes() for p in key_dir.iterdir() if not p.name.startswith("__grp__")}


def _object_path(remote: RemoteProgramCache, kernel_hash: str, file: str) -> str:
    return remote.path_for(entry_name(tpt.cache_key(tpt_key(kernel_hash), file)))


def _remote_of(chain: TieredProgramCache) -> RemoteProgramCache:
    remote = chain.shared_store
    assert isinstance(remote, RemoteProgramCache)
    return remote


# -- the round trip -------------------------------------------------------------------------------


def test_a_group_put_on_node_a_comes_back_whole_on_node_b_with_identical_bytes(compiled, node, tmp_path):
    kernel_hash, files = compiled
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    chain = _use(_file_chain(f"file://{remote_dir}"))
    node("a")
    put_group(kernel_hash, files)
    assert chain.flush(timeout=30)
    assert chain.stats()["remote"].writes == len(files) + 1  # every member and the group record

    b = node("b")
    group = get_cache_manager(kernel_hash).get_group(META)
    assert group is not None and set(group) == set(files)
    assert {name: Path(path).read_bytes() for name, path in group.items()} == files
    assert all(Path(path).parent == b / tpt_key(kernel_hash) for path in group.values())
    # Node B's directory is Triton's own layout: its FileCacheManager reads the group back.
    assert FileCacheManager(tpt_key(kernel_hash)).get_group(META) == group
    remote = chain.stats()["remote"]
    assert (remote.hits, remote.misses, remote.rejected) == (len(files) + 1, 0, 0)


def test_node_b_in_another_process_runs_triton_compile_without_compiling(tmp_path):
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()

    def run_node(name: str) -> dict[str, Any]:
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / name), TRITON_CACHE_MANAGER=MANAGER,
                   TIERED_PROGCACHE_REMOTE=f"file://{remote_dir}", TIERED_PROGCACHE_STRICT="1",
                   PYTHONPATH=os.pathsep.join([str(Path(tpt.__file__).parents[2]), str(SUPPORT.parent)]))  # fmt: skip
        done = subprocess.run([sys.executable, str(SUPPORT)], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    a = run_node("a")
    assert (a["compiles"], a["hits"]) == (1, 0)
    b = run_node("b")
    assert (b["compiles"], b["hits"]) == (0, 1)  # Triton's listener: a cache hit, no compile
    assert b["hash"] == a["hash"]
    (key_dir,) = a["files"]
    members = {n: d for n, d in a["files"][key_dir].items() if not n.startswith("__grp__")}
    assert {n: d for n, d in b["files"][key_dir].items() if not n.startswith("__grp__")} == members


def test_triton_files_and_program_cache_entries_share_a_bucket_apart(compiled, node, tmp_path):
    kernel_hash, files = compiled
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    chain = _use(_file_chain(f"file://{remote_dir}"))
    node("a")
    put_group(kernel_hash, files)
    programs = RemoteProgramCache.from_url(f"file://{remote_dir}", strict=True)
    programs.write_key(b"a cuda-core key", b"\x7fELF a cubin")
    assert chain.flush(timeout=30)
    assert [e.name for e in programs.iter_entries()] == [entry_name(b"a cuda-core key")]
    triton_names = {e.name for e in _remote_of(chain).iter_entries()}
    key = tpt_key(kernel_hash)
    assert triton_names == {entry_name(tpt.cache_key(key, f)) for f in [*files, "__grp__" + META]}
    assert {p.relative_to(remote_dir).parts[0] for p in remote_dir.rglob("*") if p.is_file()} == {"entries", "triton"}
    with pytest.raises(ValueError, match="namespace must be one of entries, triton"):
        RemoteProgramCache.from_url(f"file://{remote_dir}", namespace="kernels")


def test_a_local_hit_asks_the_remote_nothing(compiled, node, tmp_path):
    kernel_hash, files = compiled
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    chain = _use(_file_chain(f"file://{remote_dir}"))
    node("a")
    put_group(kernel_hash, files)
    assert chain.flush(timeout=30)
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(str(remote_dir)):
            opened.append(args[0])

    sys.addaudithook(audit)
    before = chain.stats()["remote"]
    for _ in range(3):
        assert get_cache_manager(kernel_hash).get_group(META) is not None
        assert get_cache_manager(kernel_hash).get_file("add_kernel.cubin") is not None
    after = chain.stats()["remote"]
    assert (after.hits, after.misses) == (before.hits, before.misses)
    assert opened == []
    assert tpt.stats()["triton-local"].hits == 3


def test_a_group_hit_in_a_slower_tier_is_promoted_into_the_faster_one(compiled, node, tmp_path):
    kernel_hash, files = compiled
    near_dir, far_dir = tmp_path / "near", tmp_path / "far"
    near_dir.mkdir()
    far_dir.mkdir()
    far = RemoteProgramCache.from_url(f"file://{far_dir}", strict=True, namespace=tpt.NAMESPACE)
    writer = _use(TieredProgramCache(tiers=[far]))
    node("a")
    put_group(kernel_hash, files)
    assert writer.flush(timeout=30)
    near = RemoteProgramCache.from_url(f"file://{near_dir}", strict=True, namespace=tpt.NAMESPACE)
    chain = _use(TieredProgramCache(tiers=[near, far]))
    node("b")
    assert get_cache_manager(kernel_hash).get_group(META) is not None
    assert chain.flush(timeout=30)
    assert {e.name for e in near.iter_entries()} == {e.name for e in far.iter_entries()}
    stats = chain.stats()
    assert (stats["remote"].misses, stats["remote"].promotions, stats["remote2"].hits) == (1, len(files) + 1, len(files) + 1)
    node("c")  # the near tier alone serves it now
    assert get_cache_manager(kernel_hash).get_group(META) is not None
    assert chain.stats()["remote"].hits == len(files) + 1 and chain.stats()["remote2"].hits == len(files) + 1


# -- what a group read refuses --------------------------------------------------------------------


def _seeded(compiled, node, tmp_path, **settings):
    kernel_hash, files = compiled
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    chain = _use(_file_chain(f"file://{remote_dir}", **settings))
    node("a")
    put_group(kernel_hash, files)
    assert chain.flush(timeout=30)
    return kernel_hash, files, chain


def _miss_on_node_b(node, kernel_hash) -> Path:
    b = node("b")
    assert get_cache_manager(kernel_hash).get_group(META) is None
    assert _local_files(b, kernel_hash) == {}  # nothing of the group was loaded: no partial group
    return b


def test_a_corrupt_member_makes_the_group_a_miss_and_loads_nothing(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path)
    path = Path(_object_path(_remote_of(chain), kernel_hash, "add_kernel.cubin"))
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    _miss_on_node_b(node, kernel_hash)
    assert chain.stats()["remote"].rejected == 1


def test_a_member_replaced_by_another_valid_entry_does_not_match_its_record(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path)
    key = tpt_key(kernel_hash)
    remote = _remote_of(chain)
    remote.write_key(tpt.cache_key(key, "add_kernel.cubin"),
                     tpt.frame(key, "add_kernel.cubin", b"\x7fELF another compile"))
    _miss_on_node_b(node, kernel_hash)
    assert chain.stats()["remote"].rejected == 1


def test_an_entry_framed_for_another_file_is_refused(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path)
    key = tpt_key(kernel_hash)
    remote = _remote_of(chain)
    ptx = remote.read_key(tpt.cache_key(key, "add_kernel.ptx"))
    remote.write_key(tpt.cache_key(key, "add_kernel.cubin"), ptx)  # a valid envelope, holding the PTX
    _miss_on_node_b(node, kernel_hash)
    with pytest.raises(EntryRejected, match="holds triton/.*add_kernel.ptx"):
        tpt.opened(ptx, key, "add_kernel.cubin")


def test_a_missing_member_makes_the_group_a_miss_and_loads_nothing(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path)
    os.remove(_object_path(_remote_of(chain), kernel_hash, "add_kernel.ptx"))
    _miss_on_node_b(node, kernel_hash)
    remote = chain.stats()["remote"]
    assert (remote.misses, remote.rejected) == (1, 0)


def test_a_missing_group_record_is_a_miss(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path)
    os.remove(_object_path(_remote_of(chain), kernel_hash, "__grp__" + META))
    _miss_on_node_b(node, kernel_hash)


def test_a_fetched_group_that_cannot_be_written_locally_is_a_miss_not_a_failed_compile(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path)
    b = node("b")
    (b / tpt_key(kernel_hash) / "add_kernel.ptx").mkdir(parents=True)  # the rename onto it fails (even as root)
    assert get_cache_manager(kernel_hash).get_group(META) is None
    assert not (b / tpt_key(kernel_hash) / ("__grp__" + META)).exists()


def test_a_read_only_remote_is_read_and_never_written(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path)
    objects = sorted(p for p in (tmp_path / "remote").rglob("*") if p.is_file())
    reader = _use(_file_chain(f"file://{tmp_path / 'remote'}", remote_read_only=True))
    node("b")
    assert get_cache_manager(kernel_hash).get_group(META) is not None
    other = dict(files, **{META: files[META].replace(b"add_kernel", b"add_kernel")})
    put_group(kernel_hash[::-1], other)  # a new kernel on a read-only node: local only
    assert reader.flush(timeout=30)
    assert sorted(p for p in (tmp_path / "remote").rglob("*") if p.is_file()) == objects
    assert reader.stats()["remote"].writes == 0
    assert FileCacheManager(tpt_key(kernel_hash[::-1])).get_group(META) is not None
    chain.close()


def test_signed_entries_from_another_key_are_refused(compiled, node, tmp_path):
    kernel_hash, files, chain = _seeded(compiled, node, tmp_path, signing_key="writer's key")
    _use(_file_chain(f"file://{tmp_path / 'remote'}", signing_key="another key"))
    _miss_on_node_b(node, kernel_hash)
    assert tpt.shared_cache().stats()["remote"].rejected == 1  # the group record, refused unread past its header
    chain.close()


# -- a remote that dies or hangs --------------------------------------------------------------------


def _redis_chain(url: str, breaker: CircuitBreaker, timeout: float) -> TieredProgramCache:
    from tiered_progcache.stores.redis_store import RedisProgramCache

    tier = RedisProgramCache.from_url(url, timeout=timeout, strict=True, breaker=breaker, namespace=tpt.NAMESPACE)
    return TieredProgramCache(tiers=[tier])


def test_a_killed_remote_fails_open_and_the_breaker_opens(compiled, node):
    pytest.importorskip("redis")
    from tiered_progcache.testing.redis_server import RedisServer

    kernel_hash, files = compiled
    clock = FakeClock()
    with RedisServer() as server:
        breaker = CircuitBreaker(3, 30.0, name="redis", clock=clock)
        chain = _use(_redis_chain(server.url, breaker, timeout=2))
        node("a")
        put_group(kernel_hash, files)
        assert chain.flush(timeout=30)
        server.kill()
        started = time.monotonic()
        for n in range(4):
            node(f"b{n}")
            assert get_cache_manager(kernel_hash).get_group(META) is None  # a miss, never an exception
            put_group(kernel_hash, files)  # the compile's writes go on locally
            assert chain.flush(timeout=30)
        assert time.monotonic() - started < 30  # refused connections fail at once
        stats = chain.stats()["remote"]
        assert stats.errors == 3 and stats.skipped > 0, stats  # three failures open the breaker...
        assert breaker.state == "open"
        assert FileCacheManager(tpt_key(kernel_hash)).get_group(META) is not None
        chain.close()


def test_a_hung_remote_costs_deadlines_until_the_breaker_opens(compiled, node):
    pytest.importorskip("redis")
    from tiered_progcache.testing.redis_server import RedisServer

    kernel_hash, files = compiled
    clock = FakeClock()
    with RedisServer() as server:
        breaker = CircuitBreaker(3, 30.0, name="redis", clock=clock)
        chain = _use(_redis_chain(server.url, breaker, timeout=0.3))
        node("a")
        put_group(kernel_hash, files)
        assert chain.flush(timeout=30)
        server.process.send_signal(signal.SIGSTOP)  # alive, accepting, never answering
        try:
            started = time.monotonic()
            for n in range(5):
                node(f"b{n}")
                assert get_cache_manager(kernel_hash).get_group(META) is None
            elapsed = time.monotonic() - started
            stats = chain.stats()["remote"]
            assert (stats.timeouts, stats.skipped) == (3, 2), stats
            assert elapsed < 3 * 0.3 + 10, elapsed  # three deadlines, then nothing waits
        finally:
            server.process.send_signal(signal.SIGCONT)
        clock.now += 30.0
        node("c")
        group = get_cache_manager(kernel_hash).get_group(META)  # the probe finds it answering again
        assert group is not None and {n: Path(p).read_bytes() for n, p in group.items()} == files
        chain.close()


# -- requests on S3 ---------------------------------------------------------------------------------


class S3Wire:
    """moto behind a keep-alive delay proxy: ``requests`` and ``sent`` (each request's method) as the wire sees them."""

    def __init__(self, proxy: DelayProxy, url: str, options: dict[str, Any]) -> None:
        self.proxy, self.url, self.options = proxy, url, options
        self._watched_from = 0

    def watch(self, remote: RemoteProgramCache) -> None:
        """Count from now: every request through this wire is the watched client's."""
        self._watched_from = len(self.proxy.sent)

    @property
    def sent(self) -> list[str]:
        return [request.method for request in self.proxy.sent[self._watched_from:]]

    def requests_during(self, action: Any) -> int:
        before = self.proxy.requests
        action()
        return self.proxy.requests - before


@pytest.fixture
def s3_wire(s3_bucket, moto_server):  # noqa: F811
    upstream = urlsplit(moto_server.endpoint_url)
    with DelayProxy(upstream.hostname, upstream.port, keep_alive=True) as proxy:
        options = dict(s3_bucket.storage_options, endpoint_url=proxy.endpoint_url, skip_instance_cache=True)
        yield S3Wire(proxy, s3_bucket.url, options)


def test_s3_a_group_hit_is_one_get_for_the_record_and_one_batch_of_member_gets(compiled, node, s3_wire):
    kernel_hash, files = compiled
    config = CacheConfig(remote=s3_wire.url, remote_options=s3_wire.options, strict=True)
    chain = _use(config.build_shared(namespace=tpt.NAMESPACE))
    node("a")
    put_group(kernel_hash, files)
    assert chain.flush(timeout=30)
    s3_wire.watch(_remote_of(chain))
    node("b")
    got: dict[str, Any] = {}
    assert s3_wire.requests_during(lambda: got.update(group=get_cache_manager(kernel_hash).get_group(META))) == 1 + len(files)
    assert s3_wire.sent == ["GET"] * (1 + len(files))  # no HEAD, no listing, one GET per object
    assert {n: Path(p).read_bytes() for n, p in got["group"].items()} == files
    assert s3_wire.requests_during(lambda: get_cache_manager(kernel_hash).get_group(META)) == 0  # local now
    node("c")
    assert s3_wire.requests_during(lambda: get_cache_manager(kernel_hash[::-1]).get_group(META)) == 1  # a miss: one GET


# -- names ------------------------------------------------------------------------------------------


def test_triton_names_are_their_own_namespace_and_say_what_they_hold():
    key = "FVYRMQVXE2YEIALCPSU7XLBS6XEFGD5RSA6MJWYCEWDRPEQ2JCAQ"
    assert tpt.cache_key(key, "add_kernel.cubin") == f"triton/{key}/add_kernel.cubin".encode()
    assert tpt.describe(tpt.frame(key, "add_kernel.cubin", b"\x7fELF")) == tpt.TritonFile(key, "add_kernel.cubin")
    assert tpt.describe(b"\x7fELF a cuda-core cubin") is None
    assert tpt.describe(tpt.FRAME_MAGIC + b"not json\n") is None
    for bad in ("", "a/b", "..", "x\0y"):
        with pytest.raises(ValueError, match="not a Triton"):
            tpt.cache_key(key, bad)
    with pytest.raises(TypeError, match="must be a str"):
        tpt.cache_key(key, b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TieredProgramCache or None"):
        tpt.use_shared_cache(object())


def test_a_group_record_over_its_bounds_is_refused():
    key, group = "K" * 52, "__grp__k.json"
    at_bound = tpt.group_record(key, group, {f"f{n}": b"" for n in range(tpt.MAX_GROUP_MEMBERS)})
    assert len(tpt.read_group_record(at_bound, key, group)) == tpt.MAX_GROUP_MEMBERS
    over = tpt.group_record(key, group, {f"f{n}": b"" for n in range(tpt.MAX_GROUP_MEMBERS + 1)})
    with pytest.raises(EntryRejected, match="more than 64"):
        tpt.read_group_record(over, key, group)
    padded = at_bound[:-1] + b" " * (tpt.MAX_GROUP_RECORD_BYTES - len(at_bound)) + b"}"
    assert len(padded) == tpt.MAX_GROUP_RECORD_BYTES and tpt.read_group_record(padded, key, group)
    with pytest.raises(EntryRejected, match="over the 65536-byte bound"):
        tpt.read_group_record(padded + b" ", key, group)
    with pytest.raises(EntryRejected, match="another key"):
        tpt.read_group_record(at_bound, "L" * 52, group)


def test_without_a_remote_the_manager_is_triton_s_file_cache_manager(compiled, node):
    kernel_hash, files = compiled
    tpt._reset_for_tests()
    node("a")
    assert tpt.shared_cache() is None
    put_group(kernel_hash, files)
    assert FileCacheManager(tpt_key(kernel_hash)).get_group(META) is not None
    assert get_cache_manager(kernel_hash).get_group(META) is not None
