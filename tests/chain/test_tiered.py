"""The chain's own behaviour: which tier answers, promotion, write policy, failures, real NVRTC compiles."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, ProgramCacheResource, make_program_cache_key

from tiered_progcache import CacheStores, TieredProgramCache, TierPolicy, stores_of
from tiered_progcache.stores.localdir import KEYED_READS, LocalDir, default_local_dir, entry_name
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.testing import WrapperEntryStore

ARCH = "sm_90"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _options() -> ProgramOptions:
    return ProgramOptions(std="c++17", arch=ARCH)


def _key(tile: int) -> bytes:
    return make_program_cache_key(
        code=matmul_source(tile), code_type="c++", options=_options(), target_type="cubin"
    )


# -- real compiles through the chain ---------------------------------------------------------


@pytest.mark.parametrize("tile", [16, 32])
def test_second_compile_is_a_memory_hit_with_identical_cubin(tmp_path, tile):
    with TieredProgramCache(tmp_path) as cache:
        first = Program(matmul_source(tile), "c++", _options()).compile("cubin", cache=cache)
        after_first = cache.stats()
        second = Program(matmul_source(tile), "c++", _options()).compile("cubin", cache=cache)
        delta = cache.stats() - after_first

    assert after_first["memory"].misses == 1 and after_first["local"].misses == 1
    assert after_first["memory"].writes == 1 and after_first["local"].writes == 1
    assert delta["memory"].hits == 1 and delta["local"].lookups == 0
    assert bytes(second.code) == bytes(first.code)
    assert bytes(first.code)[:4] == b"\x7fELF"
    # The local tier holds the raw cubin under cuda-core's own naming.
    assert LocalDir(tmp_path).read_entry(entry_name(_key(tile))) == bytes(first.code)


def test_tile_sizes_get_distinct_entries(tmp_path):
    with TieredProgramCache(tmp_path) as cache:
        for tile in (16, 32):
            Program(matmul_source(tile), "c++", _options()).compile("cubin", cache=cache)
        assert len(cache) == 2
        assert cache.get(_key(16)) != cache.get(_key(32))


_CHILD = r"""
import json, sys
from cuda.core import Program, ProgramOptions
from tiered_progcache import TieredProgramCache
from tiered_progcache.samples import matmul_source
with TieredProgramCache(sys.argv[1]) as cache:
    obj = Program(matmul_source(16), "c++", ProgramOptions(std="c++17", arch="sm_90")).compile("cubin", cache=cache)
    again = Program(matmul_source(16), "c++", ProgramOptions(std="c++17", arch="sm_90")).compile("cubin", cache=cache)
    assert bytes(again.code) == bytes(obj.code)
    print(json.dumps({"stats": cache.stats().as_dict(), "cubin": bytes(obj.code).hex()}))
"""


def test_second_process_gets_a_local_hit_and_promotes_it(tmp_path):
    with TieredProgramCache(tmp_path) as cache:
        compiled = Program(matmul_source(16), "c++", _options()).compile("cubin", cache=cache)

    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        check=True, capture_output=True, text=True, cwd=REPO_ROOT,
    ).stdout
    report = json.loads(out)
    stats = report["stats"]
    assert bytes.fromhex(report["cubin"]) == bytes(compiled.code)
    assert stats["local"]["hits"] == 1 and stats["local"]["misses"] == 0
    assert stats["memory"]["promotions"] == 1
    assert stats["memory"]["hits"] == 1  # the second compile in the child
    assert stats["local"]["writes"] == 0  # nothing was compiled and stored again


# -- promotion and policies ------------------------------------------------------------------


def test_hit_in_slow_tier_is_promoted_into_every_faster_tier(tmp_path):
    fast, middle = InMemoryProgramCache(), InMemoryProgramCache()
    slow = FileStreamProgramCache(tmp_path)
    slow[b"k"] = b"payload"
    cache = TieredProgramCache(
        tiers=[(fast, TierPolicy("fast")), (middle, TierPolicy("middle")), (slow, TierPolicy("slow"))]
    )
    assert cache.get(b"k") == b"payload"
    assert fast.get(b"k") == b"payload" and middle.get(b"k") == b"payload"
    stats = cache.stats()
    assert stats["slow"].hits == 1
    assert stats["fast"].promotions == 1 and stats["middle"].promotions == 1
    assert cache.get(b"k") == b"payload"
    assert (cache.stats() - stats)["fast"].hits == 1


@pytest.mark.skipif(not KEYED_READS, reason="utime on a descriptor: Linux and macOS")
def test_a_local_hit_is_read_by_entry_file_not_through_a_planted_link(tmp_path):
    """The chain reads cuda-core's directory itself (LocalDir.read_key): a symlinked entry, which
    cuda-core's own read follows, is a rejected miss; a whole entry is a hit, promoted as usual."""
    cache = TieredProgramCache(tmp_path / "cache")
    local = cache.local_store
    cache.tier("local").resource[b"k"] = b"payload"
    (tmp_path / "planted").write_bytes(b"not ours")
    planted = local.path_for(entry_name(b"linked"))
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(tmp_path / "planted")
    assert cache.tier("local").resource[b"linked"] == b"not ours"  # cuda-core follows it
    assert cache.get(b"linked") is None
    assert cache.get(b"k") == b"payload"
    stats = cache.stats()
    assert (stats["local"].rejected, stats["local"].hits, stats["memory"].promotions) == (1, 1, 1)


def test_a_file_tier_subclass_that_reads_its_own_way_is_read_through_its_getitem(tmp_path):
    class Upper(FileStreamProgramCache):
        def __getitem__(self, key):
            return super().__getitem__(key).upper()

    slow = Upper(tmp_path)
    slow[b"k"] = b"payload"
    cache = TieredProgramCache(tiers=[InMemoryProgramCache(), slow])
    assert cache.get(b"k") == b"PAYLOAD"


def test_no_promotion_into_tier_that_opts_out_or_is_read_only(tmp_path):
    no_promote, read_only = InMemoryProgramCache(), InMemoryProgramCache()
    slow = InMemoryProgramCache()
    slow[b"k"] = b"payload"
    cache = TieredProgramCache(
        tiers=[
            (no_promote, TierPolicy("no-promote", promote=False)),
            (read_only, TierPolicy("ro", read_only=True)),
            (slow, TierPolicy("slow")),
        ]
    )
    assert cache.get(b"k") == b"payload"
    assert no_promote.get(b"k") is None and read_only.get(b"k") is None
    cache[b"new"] = b"value"
    assert no_promote.get(b"new") == b"value"  # still written directly
    assert read_only.get(b"new") is None  # never written


def test_clear_and_len_skip_shared_tiers(tmp_path):
    shared = InMemoryProgramCache()
    cache = TieredProgramCache(
        tiers=[InMemoryProgramCache(), (shared, TierPolicy("cluster", shared=True))]
    )
    cache.update({b"a": b"1", b"b": b"2"})
    shared[b"c"] = b"3"
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0
    assert shared.get(b"a") == b"1" and len(shared) == 3


def test_background_tier_is_written_after_flush(tmp_path, cleanup):
    bg = FileStreamProgramCache(tmp_path)
    gate = threading.Event()
    cleanup.gate(gate)  # a failing assert still lets the held write go

    class Gated(ProgramCacheResource):
        """Delegates to ``bg`` but holds every write until the test opens the gate."""

        def __getitem__(self, key):
            return bg[key]

        def __setitem__(self, key, value):
            gate.wait()
            bg[key] = value

        def __delitem__(self, key):
            del bg[key]

        def __len__(self):
            return len(bg)

        def clear(self):
            bg.clear()

    tiers = [InMemoryProgramCache(), (Gated(), TierPolicy("bg", write="background"))]
    cache = cleanup.close(TieredProgramCache(tiers=tiers))
    cache[b"k"] = b"v"  # returns although the background write is blocked
    assert bg.get(b"k") is None
    assert cache.flush(timeout=0.05) is False
    gate.set()
    assert cache.flush(timeout=10) is True
    assert bg.get(b"k") == b"v"
    assert cache.stats()["bg"].writes == 1
    cache.close()


# -- failures never escape -----------------------------------------------------------------


def test_broken_local_dir_does_not_break_a_compile(tmp_path, caplog):
    root = tmp_path / "cache"
    cache = TieredProgramCache(root)
    # A real I/O failure: entries/ replaced by a plain file, so every write fails with OSError.
    entries = root / "entries"
    for sub in entries.iterdir():
        sub.rmdir()
    entries.rmdir()
    entries.write_bytes(b"not a directory")

    obj = Program(matmul_source(16), "c++", _options()).compile("cubin", cache=cache)
    assert bytes(obj.code)[:4] == b"\x7fELF"
    stats = cache.stats()
    assert stats["local"].errors >= 1 and stats["local"].writes == 0
    assert stats["memory"].writes == 1
    again = Program(matmul_source(16), "c++", _options()).compile("cubin", cache=cache)
    assert bytes(again.code) == bytes(obj.code)
    assert (cache.stats() - stats)["memory"].hits == 1
    assert any("failed a write" in r.getMessage() for r in caplog.records)


def test_tier_that_raises_on_read_is_a_counted_miss():
    class Exploding(InMemoryProgramCache):
        def __getitem__(self, key):
            raise OSError("disk on fire")

    backing = InMemoryProgramCache()
    backing[b"k"] = b"v"
    cache = TieredProgramCache(tiers=[Exploding(), backing])
    assert cache.get(b"k") == b"v"
    stats = cache.stats()
    assert stats["memory"].errors == 1 and stats["memory"].misses == 1
    assert stats["memory2"].hits == 1


# -- input validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{"max_memory_bytes": -1}, {"max_memory_bytes": 0}, {"max_local_bytes": -5}, {"max_pending_uploads": 0}]
)
def test_non_positive_sizes_are_value_errors(tmp_path, kwargs):
    with pytest.raises(ValueError, match="must be positive"):
        TieredProgramCache(tmp_path, **kwargs)


def test_bad_arguments_name_the_problem(tmp_path):
    with pytest.raises(TypeError, match="max_memory_bytes"):
        TieredProgramCache(tmp_path, max_memory_bytes="1G")
    with pytest.raises(TypeError, match="path"):
        TieredProgramCache(123)
    with pytest.raises(TypeError, match="ProgramCacheResource"):
        TieredProgramCache(tiers=[{}])
    with pytest.raises(ValueError, match="not both"):
        TieredProgramCache(tmp_path, tiers=[InMemoryProgramCache()])
    with pytest.raises(ValueError, match="named"):
        TieredProgramCache(tiers=[(InMemoryProgramCache(), TierPolicy("a")), (InMemoryProgramCache(), TierPolicy("a"))])
    with pytest.raises(ValueError, match="write mode"):
        TierPolicy("x", write="later")


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"signing_key": b"x"}, "signing_key"),
        ({"max_memory_bytes": 1 << 20, "compression": "zstd"}, "max_memory_bytes, compression"),
        ({"remote": None}, "remote"),
        ({"local_dir": "/tmp/x"}, "local_dir"),
    ],
)
def test_tiers_with_a_tier_building_setting_is_a_value_error(settings, named):
    with pytest.raises(ValueError, match="not both") as caught:
        TieredProgramCache(tiers=[InMemoryProgramCache()], **settings)
    assert f"({named})" in str(caught.value)


def test_chain_wide_settings_still_apply_with_tiers():
    with pytest.raises(ValueError, match="^max_pending_uploads: must be positive"):
        TieredProgramCache(tiers=[InMemoryProgramCache()], max_pending_uploads=-1)


def test_unknown_setting_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="remote_url"):
        TieredProgramCache(tmp_path, remote_url="s3://x/y")
    with pytest.raises(TypeError, match="remote_url"):
        TieredProgramCache(tiers=[InMemoryProgramCache()], remote_url="s3://x/y")


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"max_memory_bytes": -5}, "^max_memory_bytes: must be positive"),
        ({"compression": "bogus"}, "^compression: must be zstd or none"),  # checked though no remote is named
        ({"remote_timeout": 0}, "^remote_timeout: "),
        ({"remote": "nosuchscheme://x/y"}, "^remote: "),
        ({"signing_key": b""}, "^signing_key: "),
    ],
)
def test_bad_settings_are_value_errors_naming_them(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        TieredProgramCache(tmp_path, **settings)


def test_path_and_local_dir_name_one_setting(tmp_path):
    with TieredProgramCache(local_dir=tmp_path / "kw") as by_keyword:
        assert by_keyword.local_store.root == tmp_path / "kw"
    with pytest.raises(TypeError, match="path and local_dir"):
        TieredProgramCache(tmp_path, local_dir=tmp_path)


def test_default_dir_is_cuda_cores(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_local_dir() == tmp_path / "cuda-python" / "program-cache"
    with TieredProgramCache() as cache:
        cache[b"k"] = b"v"
        assert cache.local_store.root == tmp_path / "cuda-python" / "program-cache"
    # cuda-core's own tier on its own default directory sees the entry.
    assert FileStreamProgramCache().get(b"k") == b"v"


# -- threads -----------------------------------------------------------------------------------


def test_counters_are_exact_under_threads(tmp_path):
    cache = TieredProgramCache(tmp_path)
    keys = [f"key-{n}".encode() for n in range(20)]
    for k in keys[:10]:
        cache[k] = k * 10
    threads_n, rounds = 8, 400
    errors: list[BaseException] = []

    def worker():
        try:
            for i in range(rounds):
                k = keys[i % 20]
                got = cache.get(k)
                assert got is None or got == k * 10
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    memory = cache.stats()["memory"]
    assert memory.lookups == threads_n * rounds
    assert memory.hits == threads_n * rounds // 2
    assert memory.bytes_read == sum(len(k) * 10 for k in keys[:10]) * threads_n * rounds // 20


# -- the stores behind a cache -------------------------------------------------------------------


def _shared_store(*, read_only: bool = False) -> WrapperEntryStore:
    """A shared entry store that is no remote class of ours (a wrapper around a fresh memory:// one):
    what the chain sees of it is only what ``EntryStore`` declares."""
    url = f"memory://shared-{uuid.uuid4().hex}/kernels"
    RemoteProgramCache.from_url(url, strict=True)  # the root, so that a read-only one opens
    return WrapperEntryStore(RemoteProgramCache.from_url(url, read_only=read_only, strict=True))


def test_a_shared_entry_store_gets_the_remote_policy(tmp_path):
    shared, read_only = _shared_store(), _shared_store(read_only=True)
    with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path), shared, read_only]) as cache:
        policies = {t.name: t.policy for t in cache.tiers}
        assert policies["remote"] == TierPolicy("remote", write="background", shared=True)
        assert policies["remote2"] == TierPolicy("remote2", read_only=True, write="background", shared=True)
        assert cache.shared_stores == (shared, read_only) and cache.shared_store is shared
        cache[b"k"] = b"v"
        assert cache.flush(timeout=10)
    assert [e.name for e in shared.iter_entries()] == [entry_name(b"k")] and shared.read_key(b"k") == b"v"
    assert list(read_only.iter_entries()) == []


def test_stores_of_a_chain_a_file_tier_a_bare_store_and_anything_else(tmp_path):
    shared = _shared_store()
    with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "chain"), shared]) as chain:
        stores = stores_of(chain)
        assert isinstance(stores.local, LocalDir) and stores.local.root == tmp_path / "chain"
        assert stores.shared is shared
        assert (chain.local_store.root, chain.shared_store) == (stores.local.root, shared)
    with TieredProgramCache(tmp_path / "local-only") as local_only:
        assert stores_of(local_only).shared is None and local_only.shared_stores == ()
    with TieredProgramCache(tiers=[InMemoryProgramCache()]) as memory_only:
        assert stores_of(memory_only) == CacheStores(None, None) and memory_only.local_store is None

    files = stores_of(FileStreamProgramCache(tmp_path / "files"))
    assert files.local.root == tmp_path / "files" and files.shared is None
    assert stores_of(shared) == CacheStores(None, shared)
    assert stores_of(InMemoryProgramCache()) == CacheStores(None, None)
