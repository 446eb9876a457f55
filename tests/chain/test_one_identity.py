"""Every tier is one entry store, read by key; the chain has one read entry point (docs/architecture.md)."""

from __future__ import annotations

import logging

import pytest
from cuda.core import Program
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, ProgramCacheResource

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache._cudacore import memory_cache_reader
from tiered_progcache.chain.tier import Tier, store_of
from tiered_progcache.chain.stats import MetadataKey
from tiered_progcache.stores.coretiers import MemoryStore, ResourceStore
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.samples import matmul_source

from support import options


class _Dict(ProgramCacheResource):
    """A user's own resource: cuda-core's five methods over a dict."""

    def __init__(self) -> None:
        self.d: dict[bytes, bytes] = {}

    def __getitem__(self, key):
        return self.d[key]

    def __setitem__(self, key, value):
        self.d[key] = bytes(value)

    def __delitem__(self, key):
        del self.d[key]

    def __len__(self):
        return len(self.d)

    def clear(self):
        self.d.clear()


@pytest.fixture
def remote(tmp_path):
    (tmp_path / "bucket").mkdir()
    with RemoteProgramCache.from_url((tmp_path / "bucket").as_uri(), strict=True) as r:
        yield r


# -- what each source becomes ----------------------------------------------------------------------


def test_each_source_becomes_one_store_once(tmp_path, remote):
    memory, files, own = InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"), _Dict()
    tiers = [Tier(source, TierPolicy(f"t{n}")) for n, source in enumerate([memory, files, own, remote])]
    assert [type(t.backend) for t in tiers] == [MemoryStore, LocalDir, ResourceStore, RemoteProgramCache]
    assert [t.resource for t in tiers] == [memory, files, own, remote]  # what was given, for inspection
    assert tiers[1].backend.cache is files and tiers[1].local is tiers[1].backend
    assert tiers[3].backend is remote and tiers[3].entries is remote
    assert tiers[0].entries is None and tiers[2].entries is None  # keyed only: never listed by name
    assert [t.location for t in tiers] == ["InMemoryProgramCache, this process", str(tmp_path / "local"),
                                           "_Dict, this process", remote.location]  # fmt: skip
    with pytest.raises(TypeError, match="^a tier must be a tiered_progcache EntryStore or a cuda.core "
                                        "ProgramCacheResource, got dict$"):  # fmt: skip
        store_of({})  # type: ignore[arg-type]


def test_the_package_defines_one_program_cache_resource():
    import importlib
    import pkgutil
    import types

    found = set()
    for module in pkgutil.walk_packages(tpc.__path__, "tiered_progcache."):
        if module.name.startswith(("tiered_progcache.triton", "tiered_progcache.cupy", "tiered_progcache.__main__")):
            continue  # optional imports; scanned by tests/test_architecture.py's class walk
        loaded = importlib.import_module(module.name)
        for value in vars(loaded).values():
            # ``dict[str, str]`` passes ``isinstance(..., type)`` on Python 3.10 and is no class
            if (isinstance(value, type) and not isinstance(value, types.GenericAlias)
                    and issubclass(value, ProgramCacheResource)
                    and value.__module__.startswith("tiered_progcache")):  # fmt: skip
                found.add(value.__qualname__)
    assert found == {"TieredProgramCache"}


def test_a_keyed_store_refuses_every_by_name_call_naming_why():
    store = ResourceStore(_Dict())
    message = "^_Dict, this process is addressed by cache key only; it cannot {} by entry name$"
    name = entry_name(b"k")
    for call, verb in ((lambda: store.read_entry(name), "read"), (lambda: store.write_entry(name, b"x"), "write"),
                       (lambda: store.create_entry(name, b"x"), "create"), (lambda: store.delete_entry(name), "delete"),
                       (lambda: list(store.iter_entries()), "list")):  # fmt: skip
        with pytest.raises(TypeError, match=message.format(verb)):
            call()
    with pytest.raises(TypeError, match="^ResourceStore wraps a cuda.core ProgramCacheResource, got dict$"):
        ResourceStore({})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^MemoryStore wraps a cuda.core InMemoryProgramCache, got _Dict$"):
        MemoryStore(_Dict())  # type: ignore[arg-type]


def test_the_memory_read_keeps_cuda_cores_lru_and_a_subclass_reads_its_own_way():
    memory = InMemoryProgramCache(max_size_bytes=8)
    memory[b"a"], memory[b"b"] = b"1111", b"2222"
    read = memory_cache_reader(memory)
    assert read(b"a") == b"1111"  # a read is a use: b is now the oldest
    memory[b"c"] = b"3333"
    assert memory.get(b"b") is None and memory.get(b"a") == b"1111"
    with pytest.raises(KeyError) as miss:
        read(b"absent")
    assert type(miss.value) is KeyError

    class Counting(InMemoryProgramCache):
        reads = 0

        def __getitem__(self, key):
            Counting.reads += 1
            return super().__getitem__(key)

    counting = Counting()
    counting[b"k"] = b"v"
    assert memory_cache_reader(counting)(b"k") == b"v" and Counting.reads == 1


def test_a_file_tier_written_through_the_chain_keeps_cuda_cores_size_cap(tmp_path):
    files = FileStreamProgramCache(tmp_path / "local", max_size_bytes=10_000)
    with TieredProgramCache(tiers=[InMemoryProgramCache(), files]) as cache:
        for n in range(5):
            cache[b"k%d" % n] = bytes([n]) * 4000
        held = sum(e.size for e in cache.local_store.iter_entries())
    assert held <= 10_000  # cuda-core evicted: the write went through its tier, not around it


def test_a_users_resource_is_a_full_tier_by_key():
    own = _Dict()
    with TieredProgramCache(tiers=[InMemoryProgramCache(), own]) as cache:
        cache[b"k"] = b"v"
        assert own.d == {b"k": b"v"} and len(cache) == 1
        cache.tier("memory").resource.clear()
        assert cache.get(b"k") == b"v" and cache.stats()["tier1"].hits == 1
        del cache[b"k"]
        assert own.d == {}
        stats = cache.stats()["tier1"]
        assert (stats.entries, stats.bytes_held) == (0, None)


# -- one read entry point ----------------------------------------------------------------------------


def test_where_reads_the_nearby_or_the_shared_half_of_one_get(tmp_path, remote):
    remote.write_key(b"far", b"from the remote")
    with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"),
                                   (remote, TierPolicy("remote", shared=True))]) as cache:  # fmt: skip
        cache.tier("local").resource[b"near"] = b"from disk"
        assert cache.get(b"far", where="nearby") is None
        assert cache.get(b"near", b"default", where="shared") == b"default"
        assert cache.get(b"far", where="shared") == b"from the remote"  # and promoted
        assert cache.get(b"near", where="nearby") == b"from disk"
        assert cache.get("far", where="nearby") == b"from the remote"  # str keys alias, from memory now
        stats = cache.stats()
        assert [(stats[t].hits, stats[t].misses) for t in ("memory", "local", "remote")] == [(1, 2), (1, 1), (1, 1)]
        assert (stats["memory"].promotions, stats["local"].promotions) == (2, 1)
        with pytest.raises(ValueError, match="^where must be one of all, nearby, shared, got 'remote'$"):
            cache.get(b"far", where="remote")


def test_a_metadata_read_through_where_is_promoted_not_counted(tmp_path, remote):
    remote.write_key(b"meta", b"symbols")
    with TieredProgramCache(tiers=[InMemoryProgramCache(), (remote, TierPolicy("remote", shared=True))]) as cache:
        assert cache.get(MetadataKey(b"meta"), where="nearby") is None
        assert cache.get(MetadataKey(b"meta"), where="shared") == b"symbols"
        assert cache.tier("memory").resource.get(b"meta") == b"symbols"
        stats = cache.stats()
        assert (stats["memory"].hits, stats["memory"].misses, stats["remote"].hits) == (0, 0, 0)


def test_while_debug_is_on_every_first_tier_hit_is_timed_and_logged_by_the_chain(caplog):
    cache = TieredProgramCache(tiers=[InMemoryProgramCache()])
    cache[b"warm-key"] = b"w"
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache"):
        for _ in range(3):
            assert cache.get(b"warm-key") == b"w"
    lines = [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.chain.tiered"]
    assert lines == [f"lookup {b'warm-key'[:8].hex()}: memory hit (1 bytes)"] * 3
    assert cache.stats()["memory"].hits == 3


# -- a bare store ----------------------------------------------------------------------------------------


def test_compile_takes_a_bare_entry_store_and_cuda_core_is_given_the_chain(remote):
    opts = options()
    src = matmul_source(16)
    tpc.compile(src, "c++", opts, cache=remote)
    names = [e.name for e in remote.iter_entries()]
    assert len(names) >= 1  # the kernel (and its manifest), written synchronously
    tpc.compile(src, "c++", opts, cache=remote)
    assert [e.name for e in remote.iter_entries()] == names  # the second call hit: nothing new
    with pytest.raises(TypeError, match="ProgramCacheResource"):
        Program(src, "c++", opts).compile("cubin", cache=remote)  # cuda-core's own refusal
    other = matmul_source(32)
    with TieredProgramCache(tiers=[(remote, TierPolicy("remote", shared=True))]) as chain:
        for _ in range(2):
            Program(other, "c++", opts).compile("cubin", cache=chain)
        assert (chain.stats()["remote"].misses, chain.stats()["remote"].hits) == (1, 1)
