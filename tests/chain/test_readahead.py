"""A read started ahead of its lookup: the lookup that takes it is the one counted, and nothing is read twice.

What direct mode uses to read a fresh node's entry while it hashes the headers (chain/readahead.py).
"""

from __future__ import annotations

import logging
import threading
import uuid

from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

from tiered_progcache import TieredProgramCache
from tiered_progcache.chain.policy import TierPolicy
from tiered_progcache.chain.readahead import MAX_PENDING, ReadAhead
from tiered_progcache.chain.tier import Tier
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing import WrapperEntryStore

from support import FileBackDoor

KEY = b"k" * 32
VALUE = b"\x7fELF" + bytes(200)


def _shared() -> WrapperEntryStore:
    url = f"memory://ahead-{uuid.uuid4().hex}/kernels"
    return WrapperEntryStore(RemoteProgramCache.from_url(url, strict=True))


def _chain(tmp_path, shared: WrapperEntryStore) -> TieredProgramCache:
    return TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"), shared])


def test_the_lookup_that_takes_a_read_ahead_is_counted_once_and_reads_nothing_again(tmp_path):
    shared = _shared()
    shared.write_key(KEY, VALUE)
    gate = shared.hold("read_entry")
    with _chain(tmp_path, shared) as chain:
        before = chain.stats()
        chain.read_ahead(KEY)
        assert gate.wait_arrived()  # the read began before any lookup asked
        gate.open()
        assert chain.get(KEY) == VALUE
        delta = chain.stats() - before
        assert (delta["remote"].hits, delta["remote"].misses, delta["remote"].bytes_read) == (1, 0, len(VALUE))
        assert (delta["local"].misses, delta["memory"].misses) == (1, 1)
        assert chain.get(KEY) == VALUE  # promoted: memory answers
        assert shared.calls["read_entry"] == 1


def test_a_read_ahead_of_an_absent_or_failing_entry_is_its_lookups_miss(tmp_path):
    shared = _shared()
    with _chain(tmp_path, shared) as chain:
        chain.read_ahead(KEY)
        assert chain.get(KEY) is None
        assert ((chain.stats())["remote"].misses, chain.stats()["remote"].errors) == (1, 0)
        shared.fail("read_entry", ConnectionError("down"), times=1)
        chain.read_ahead(b"j" * 32)
        assert chain.get(b"j" * 32) is None
        assert (chain.stats()["remote"].misses, chain.stats()["remote"].errors) == (2, 1)
        assert shared.calls["read_entry"] == 2  # each read once: the lookups took the reads made ahead


def test_a_read_no_lookup_takes_counts_nothing_and_one_started_twice_reads_once(tmp_path):
    shared = _shared()
    shared.write_key(KEY, VALUE)
    with _chain(tmp_path, shared) as chain:
        tier = chain.tier("remote")
        ahead = ReadAhead(tier, [])
        gate = shared.hold("read_entry")
        ahead.start(KEY)
        assert gate.wait_arrived()
        ahead.start(KEY)  # pending already: no second read
        gate.open()
        fetched = ahead.take(KEY)
        assert (fetched.data, fetched.error) == (VALUE, None)
        assert (tier.counters.hits, tier.counters.misses, tier.counters.bytes_read) == (0, 0, 0)
        assert ahead.take(KEY) is None  # taken once
        assert tier.lookup_fetched(KEY, fetched) == VALUE and tier.counters.hits == 1
        assert shared.calls["read_entry"] == 1


def test_an_entry_a_nearer_tier_holds_is_not_read_from_the_shared_one(tmp_path):
    shared = _shared()
    shared.write_key(KEY, VALUE)
    with _chain(tmp_path, shared) as chain:
        chain[KEY] = VALUE  # memory and local hold it (the shared write goes in the background)
        assert chain.flush(10)
        shared.reset_counts()
        ahead = ReadAhead(chain.tier("remote"), [chain.tier("memory"), chain.tier("local")])
        ahead.start(KEY)
        assert ahead.take(KEY) is None and shared.calls["read_entry"] == 0
        ahead = ReadAhead(chain.tier("remote"), [chain.tier("local")])
        chain.tier("local").backend.delete_key(KEY)
        ahead.start(KEY)
        assert ahead.take(KEY).data == VALUE and shared.calls["read_entry"] == 1


def test_at_most_max_pending_reads_wait_for_a_lookup(tmp_path):
    shared = _shared()
    with _chain(tmp_path, shared) as chain:
        ahead = ReadAhead(chain.tier("remote"), [])
        keys = [n.to_bytes(32, "big") for n in range(MAX_PENDING + 1)]
        for key in keys:
            ahead.start(key)
        assert MAX_PENDING == 64
        assert ahead.take(keys[0]) is None  # the oldest, dropped
        assert all(ahead.take(key).error is not None for key in keys[1:])  # each absent: a KeyError, kept


def test_a_chain_without_a_shared_tier_reads_nothing_ahead(tmp_path):
    with TieredProgramCache(tmp_path / "local") as chain:
        chain.read_ahead(KEY)
        assert chain.get(KEY) is None and chain.stats()["local"].misses == 1


def test_each_read_runs_on_a_daemon_thread_named_for_its_key(tmp_path):
    """A read in flight never holds the process's exit (it ends within the store's deadline anyway)."""
    shared = _shared()
    shared.write_key(KEY, VALUE)
    with _chain(tmp_path, shared) as chain:
        ahead = ReadAhead(chain.tier("remote"), [])
        gate = shared.hold("read_entry")
        try:
            ahead.start(KEY)
            assert gate.wait_arrived()
            readers = [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-ahead-")]
            assert [(t.name, t.daemon) for t in readers] == [(f"tiered-progcache-ahead-{KEY[:4].hex()}", True)]
        finally:
            gate.open()
        assert ahead.take(KEY).data == VALUE


def test_a_read_that_raises_is_logged_and_left_to_the_lookup(tmp_path, caplog):
    """What no tier's read catches (not an ``Exception``) costs the read ahead only: logged, and the lookup reads."""

    class Interrupted(BaseException):
        pass

    shared, nearby = _shared(), _shared()
    nearby.fail("read_entry", Interrupted("a bug"))
    with _chain(tmp_path, shared) as chain:
        ahead = ReadAhead(chain.tier("remote"), [Tier(nearby, TierPolicy("nearby"))])
        with caplog.at_level(logging.DEBUG, "tiered_progcache.chain.readahead"):
            ahead.start(KEY)
            assert ahead.take(KEY) is None
        assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.chain.readahead"] == [
            f"read ahead of {KEY[:8].hex()} failed: Interrupted('a bug')"]
        assert shared.calls["read_entry"] == 0


def test_a_corrupt_entry_read_ahead_is_rejected_and_replaced_by_the_next_write(tmp_path):
    """Writes to a store with conditional creates never rewrite an entry, except one a read found corrupt:
    a read made ahead is that read too."""
    (tmp_path / "bucket").mkdir()
    remote = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri(), strict=True)
    assert remote.atomic_create
    with TieredProgramCache(tiers=[InMemoryProgramCache(), (remote, TierPolicy("remote", shared=True))]) as chain:
        chain[KEY] = VALUE
        FileBackDoor(tmp_path / "bucket").write(entry_name(KEY), b"not an envelope")
        chain.tier("memory").backend.delete_key(KEY)
        chain.read_ahead(KEY)
        assert chain.get(KEY) is None and chain.stats()["remote"].rejected == 1
        chain[KEY] = VALUE + b"again"
        chain.tier("memory").backend.delete_key(KEY)
        assert chain.get(KEY) == VALUE + b"again"


def test_a_lookup_is_timed_in_milliseconds_from_its_read_hit_or_miss(tmp_path):
    """The read's own time, in ms: a store that takes at least 50 ms per read shows at least 50 (and not
    seconds' worth), whether the lookup read it or took a read made ahead, and for a miss as for a hit."""
    shared = _shared()
    shared.write_key(KEY, VALUE)
    shared.delay("read_entry", 0.05)  # a real pause: a lower bound on the read's time, not a synchronization
    for ahead in (False, True):
        for key in (KEY, b"absent" * 6):
            with _chain(tmp_path / f"{ahead}-{key[:1].hex()}", shared) as chain:
                if ahead:
                    chain.read_ahead(key)
                chain.get(key)
                ms = chain.stats()["remote"].get_p50_ms
                assert 50 <= ms < 60_000, (ahead, key, ms)
