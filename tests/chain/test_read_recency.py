"""Issue 28 item 16: a hit served from memory keeps its local file young, so the local cap evicts what is not used.

cuda-core's ``test_filestream_cache_atime_lru_promotes_recently_read``, on the chain: two
entries written, the older one read, a third written over the cap; the one read stays.
Memory hits touch no file; the chain touches the files of what memory served before its
next local write (and at close), at most ``RECENCY_BATCH`` of them.
"""

from __future__ import annotations

import os

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import tiered
from tiered_progcache.stores.localdir import KEYED_READS
from tiered_progcache.stores.store import entry_name

pytestmark = pytest.mark.skipif(not KEYED_READS, reason="the chain reads cuda-core's files by key only here")

PAYLOAD = 4000


def _atime_ns(cache: TieredProgramCache, key: bytes) -> int:
    return os.stat(cache.local_store.path_for(entry_name(key))).st_atime_ns


def _aged(cache: TieredProgramCache, *keys: bytes) -> None:
    """Give the files distinct, old atimes in the order given (no sleeps: explicit times)."""
    for n, key in enumerate(keys):
        path = cache.local_store.path_for(entry_name(key))
        os.utime(path, ns=(1_000_000_000 * (n + 1), os.stat(path).st_mtime_ns))


def test_atime_lru_keeps_the_entry_memory_served(tmp_path):
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    with TieredProgramCache(tmp_path / "c", max_local_bytes=int(2.5 * PAYLOAD)) as cache:
        cache[a] = b"A" * PAYLOAD
        cache[b] = b"B" * PAYLOAD
        _aged(cache, a, b)  # a is the older by atime: plain LRU would evict it
        assert cache.get(a) == b"A" * PAYLOAD
        assert cache.stats()["memory"].hits == 1 and cache.stats()["local"].hits == 0  # served by memory
        cache[c] = b"C" * PAYLOAD  # over the cap: cuda-core evicts the oldest atime
    with TieredProgramCache(tmp_path / "c") as fresh:
        assert fresh.get(a) == b"A" * PAYLOAD and fresh.stats()["local"].hits == 1
        assert fresh.get(b) is None


def test_memory_hits_touch_no_file_until_the_next_local_write(tmp_path):
    a, b = b"a" * 32, b"b" * 32
    with TieredProgramCache(tmp_path / "c") as cache:
        cache[a] = b"A"
        _aged(cache, a)
        for _ in range(200):
            cache.get(a)
        assert _atime_ns(cache, a) == 1_000_000_000  # 200 memory hits, no file touched
        cache[b] = b"B"
        assert _atime_ns(cache, a) > 1_000_000_000


def test_close_touches_what_memory_served(tmp_path):
    a = b"a" * 32
    cache = TieredProgramCache(tmp_path / "c")
    cache[a] = b"A"
    _aged(cache, a)
    cache.get(a)
    cache.close()
    assert _atime_ns(cache, a) > 1_000_000_000


def test_at_most_a_batch_of_files_is_touched_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tiered, "RECENCY_BATCH", 3)
    keys = [bytes([n]) * 32 for n in range(6)]
    with TieredProgramCache(tmp_path / "c") as cache:
        for k in keys:
            cache[k] = b"x"
        _aged(cache, *keys)
        for k in keys:
            cache.get(k)
        cache[b"z" * 32] = b"z"
        touched = [k for k in keys if _atime_ns(cache, k) > 10_000_000_000]
    assert touched == keys[3:]  # the three memory used last
