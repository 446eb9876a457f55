"""The chain's promises, grouped by behaviour: reads and promotion, background writes, byte caps, deletes and
clear(), counters, the failure policy, construction. Each test fails with its promise broken; what a test
starts (a held tier, a chain, a thread) is undone at teardown."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, ProgramCacheResource

from tiered_progcache import CacheConfig, DeleteFailed, TieredProgramCache, TierPolicy
from tiered_progcache.errors import EntryRejected, TierUnavailable
from tiered_progcache.stores.localdir import LocalDir, entry_name
from tiered_progcache.stores.remote import RemoteProgramCache


class Gated(InMemoryProgramCache):
    """Holds every write until ``gate`` is set; ``started`` is set when the first write arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()

    def __setitem__(self, key, value):
        self.started.set()
        self.gate.wait()
        super().__setitem__(key, value)


class Slow(InMemoryProgramCache):
    """Every read takes at least DELAY_S: the latency that stats() must report in milliseconds."""

    DELAY_S = 0.05

    def __getitem__(self, key):
        time.sleep(self.DELAY_S)  # the quantity measured, not a synchronisation
        return super().__getitem__(key)


class SlowWrites(InMemoryProgramCache):
    def __setitem__(self, key, value):
        time.sleep(0.05)  # an upload that takes a while (the quantity, not a synchronisation)
        super().__setitem__(key, value)


class Broken(InMemoryProgramCache):
    """A tier whose every operation but ``get`` of stored keys fails with ``OSError(what)``."""

    def __init__(self, what: str = "disk gone", *, reads: bool = False) -> None:
        super().__init__()
        self.what, self.reads, self.closes = what, reads, 0

    def __getitem__(self, key):
        if self.reads:
            raise OSError(self.what)
        return super().__getitem__(key)

    def __delitem__(self, key):
        raise OSError(self.what)

    def __len__(self):
        raise OSError(self.what)

    def clear(self):
        raise OSError(self.what)

    def close(self):
        self.closes += 1
        raise OSError(self.what)


class CountsCloses(InMemoryProgramCache):
    def __init__(self) -> None:
        super().__init__()
        self.closes = 0

    def close(self):
        self.closes += 1


class Faulty(InMemoryProgramCache):
    def __init__(self, exc: Exception) -> None:
        super().__init__()
        self.exc = exc

    def __getitem__(self, key):
        raise self.exc

    def __setitem__(self, key, value):
        raise self.exc

    def __delitem__(self, key):
        raise self.exc


class _Custom(ProgramCacheResource):
    """A tier that is neither cuda-core's nor an entry store."""

    def __getitem__(self, key):
        raise KeyError(key)

    def __setitem__(self, key, value):
        pass

    def __delitem__(self, key):
        raise KeyError(key)

    def __len__(self):
        return 0

    def clear(self):
        pass


_FAULTS = [
    # exception, read counter, read warning, write counter, write warning
    (EntryRejected("bad digest"), "rejected", "tier t rejected an entry: 'bad digest'", "errors",
     "tier t failed a write (dropped): EntryRejected('bad digest')"),
    (TierUnavailable("cooling down"), "skipped", None, "skipped", None),
    (TimeoutError("slow"), "timeouts", "tier t timed out on a read (counted as a miss): slow", "timeouts",
     "tier t timed out on a write (dropped): slow"),
    (OSError("gone"), "errors", "tier t failed a read (counted as a miss): OSError('gone')", "errors",
     "tier t failed a write (dropped): OSError('gone')"),
]  # fmt: skip


@pytest.fixture
def gated(cleanup) -> Gated:
    """A :class:`Gated` tier whose gate opens at teardown, so no write-back worker stays held in it."""
    tier = Gated()
    cleanup.gate(tier.gate)
    return tier


@pytest.fixture
def chain(cleanup):
    """``TieredProgramCache(...)``, closed at teardown (after every gate opened)."""

    def make(*args, **kwargs) -> TieredProgramCache:
        return cleanup.close(TieredProgramCache(*args, **kwargs), 30)

    return make


class TestReadsAndPromotion:
    """A read answers from the first tier that holds the entry, promotes it upward, and names where it came from."""

    def test_getitem_returns_a_stored_entry_from_every_depth(self, tmp_path):
        """Mutant: ``cache[key]`` raising KeyError for a stored key (the contract checks ``[]`` only on a miss)."""
        slow = FileStreamProgramCache(tmp_path)
        slow[b"deep"] = b"from-disk"
        cache = TieredProgramCache(tiers=[InMemoryProgramCache(), slow])
        cache[b"top"] = b"from-memory"
        assert cache[b"top"] == b"from-memory"
        assert cache[b"deep"] == b"from-disk"
        with pytest.raises(KeyError):
            cache[b"absent"]

    def test_missing_keys_raise_keyerror_with_the_key(self):
        cache = TieredProgramCache(tiers=[InMemoryProgramCache()])
        for op in (lambda: cache[b"absent"], lambda: cache.__delitem__(b"absent")):
            with pytest.raises(KeyError) as raised:
                op()
            assert raised.value.args == (b"absent",)

    def test_a_promotion_that_lands_is_counted_once_in_each_tier(self):
        source = InMemoryProgramCache()
        source[b"k"] = b"v"
        cache = TieredProgramCache(tiers=[InMemoryProgramCache(), (source, TierPolicy("source"))])
        assert cache.get(b"k") == b"v"
        memory = cache.stats()["memory"]
        assert (memory.promotions, memory.writes, memory.bytes_written) == (1, 1, 1)
        assert memory.put_p50_ms is not None and memory.put_p50_ms < 1000

    def test_debug_logging_names_the_tier_that_answered(self, caplog):
        slow = InMemoryProgramCache()
        slow[b"deep-key-0123"] = b"deep"
        cache = TieredProgramCache(tiers=[InMemoryProgramCache(), slow])
        cache[b"top-key-0123"] = b"top"
        with caplog.at_level(logging.DEBUG, logger="tiered_progcache"):
            cache.get(b"top-key-0123")
            cache.get(b"deep-key-0123")
            cache.get(b"nowhere!-0123")
        assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.chain.tiered"] == [
            f"lookup {b'top-key-0123'[:8].hex()}: memory hit (3 bytes)",
            f"lookup {b'deep-key-0123'[:8].hex()}: memory2 hit (4 bytes)",
            f"lookup {b'nowhere!-0123'[:8].hex()}: miss in every tier",
        ]


class TestBackgroundWrites:
    """A background tier's writes queue within their bounds (exactly the overflow is dropped) and drain
    within close()'s and flush()'s timeout."""

    def test_full_write_back_queue_drops_exactly_the_overflow(self, gated, chain):
        """One write under way (held), two queued (max_pending_uploads=2): of six, exactly three are dropped."""
        held = gated
        cache = chain(
            tiers=[InMemoryProgramCache(), (held, TierPolicy("bg", write="background"))], max_pending_uploads=2
        )
        cache[b"k0"] = b"v"
        assert held.started.wait(30)  # k0 is under way, so the queue is empty again
        for n in range(1, 6):
            cache[b"k%d" % n] = b"v"
        assert cache.stats()["bg"].dropped == 3
        held.gate.set()
        assert cache.flush(timeout=30) is True
        assert [held.get(b"k%d" % n) for n in range(6)] == [b"v", b"v", b"v", None, None, None]
        cache.close()

    def test_max_pending_upload_bytes_reaches_a_chain_given_as_tiers(self, gated, chain):
        held = gated
        cache = chain(
            tiers=[InMemoryProgramCache(), (held, TierPolicy("bg", write="background"))], max_pending_upload_bytes=10
        )
        cache[b"a"] = b"123456"
        cache[b"b"] = b"123456"  # 12 bytes queued or under way: over 10
        assert cache.stats()["bg"].dropped == 1
        held.gate.set()
        cache.close()

    def test_the_default_upload_byte_bound_is_256_mib(self, gated, chain):
        """docs/configuration.md and docs/architecture.md state 256 MiB: exactly that fits, one byte more is dropped."""
        assert CacheConfig().max_pending_upload_bytes == 256 << 20
        held = gated
        cache = chain(tiers=[InMemoryProgramCache(), (held, TierPolicy("bg", write="background"))])
        cache[b"a"] = bytes(256 << 20)  # exactly the bound: queued
        cache[b"b"] = b"x"  # one byte past it: dropped
        assert cache.stats()["bg"].dropped == 1
        held.gate.set()
        cache.close()

    def test_close_passes_its_timeout_on_and_returns_with_an_upload_stuck(self, gated, chain, cleanup):
        """Mutant: close(timeout) draining with no timeout would hang forever on a stuck upload."""
        stuck = gated
        cache = chain(tiers=[InMemoryProgramCache(), (stuck, TierPolicy("bg", write="background"))])
        cache[b"k"] = b"v"
        assert stuck.started.wait(30)
        closer = cleanup.thread(lambda: cache.close(timeout=0.2))
        closer.join(30)
        alive = closer.is_alive()
        stuck.gate.set()
        assert not alive, "close(timeout=0.2) did not return while an upload was stuck"

    @pytest.mark.parametrize("timeout", [None, 30.0])
    def test_close_waits_for_the_kept_work_then_closes_the_tiers(self, timeout, chain, cleanup):
        """A lease's release after its upload (``keep_until_closed``) runs on the tiers before close() closes them.

        Mutants: the kept work not waited for (the tiers closed under it), or waited for after the tiers closed;
        close(timeout=None) joining with a deadline it has not got."""
        tier = CountsCloses()
        cache = chain(tiers=[tier])
        joined, closes_seen = threading.Event(), []
        kept = cleanup.thread(lambda: (joined.wait(30), closes_seen.append(tier.closes)))
        join = kept.join
        kept.join = lambda timeout=None: (joined.set(), join(timeout))[1]  # the work goes on once close() waits on it
        cache.keep_until_closed(kept)
        closed = []
        closer = cleanup.thread(lambda: (cache.close(timeout), closed.append(True)))
        closer.join(60)
        assert joined.is_set() and closed == [True] and closes_seen == [0] and tier.closes == 1

    def test_close_gives_the_kept_work_what_is_left_of_its_timeout(self, chain, cleanup):
        """Mutant: the kept work joined without the deadline (close(timeout=0.2) hangs on a release that hangs)."""
        cache = chain(tiers=[InMemoryProgramCache()])
        go = threading.Event()
        cache.keep_until_closed(cleanup.thread(lambda: go.wait(60)))
        closer = cleanup.thread(lambda: cache.close(timeout=0.2))
        closer.join(30)
        alive = closer.is_alive()
        go.set()
        assert not alive, "close(timeout=0.2) did not return while kept work hung"

    def test_close_drains_for_at_most_30_s_by_default(self, gated, chain, monkeypatch):
        """docs/configuration.md states 30 s for close() of the chain: the drain it starts is given at most that (the
        upload is let go when the drain begins, so nothing waits)."""
        stuck = gated
        cache = chain(tiers=[InMemoryProgramCache(), (stuck, TierPolicy("bg", write="background"))])
        cache[b"k"] = b"v"
        assert stuck.started.wait(30)
        (writeback,) = [tier.writeback for tier in cache.tiers if tier.writeback is not None]
        given: list[float | None] = []
        drain = writeback.close
        monkeypatch.setattr(writeback, "close",
                            lambda timeout=None: (given.append(timeout), stuck.gate.set(), drain(timeout))[2])
        cache.close()
        (timeout,) = given
        assert timeout is not None and 0.0 < timeout <= 30.0

    def test_close_past_its_deadline_gives_the_uploads_and_the_kept_work_no_more_time(self, gated, chain, cleanup,
                                                                                     monkeypatch):
        """close(timeout=0) hands the drain and the kept work's join what is left of its deadline: exactly 0 s each
        (a floor above 0 would make every close() past its deadline wait that much longer). Each wait is recorded."""
        stuck = gated
        cache = chain(tiers=[InMemoryProgramCache(), (stuck, TierPolicy("bg", write="background"))])
        cache[b"k"] = b"v"
        assert stuck.started.wait(30)
        (writeback,) = [tier.writeback for tier in cache.tiers if tier.writeback is not None]
        given: list[tuple[str, float | None]] = []
        drain = writeback.close
        monkeypatch.setattr(writeback, "close", lambda timeout=None: (given.append(("drain", timeout)), drain(timeout))[1])
        go = threading.Event()
        kept = cleanup.thread(lambda: go.wait(60))
        join = kept.join
        kept.join = lambda timeout=None: (given.append(("join", timeout)), join(timeout))[1]  # type: ignore[method-assign]
        cache.keep_until_closed(kept)
        try:
            cache.close(timeout=0)
        finally:
            go.set()
            stuck.gate.set()
        assert given == [("drain", 0.0), ("join", 0.0)]

    @pytest.mark.parametrize("timeout", [None, 30.0])
    def test_close_and_flush_drain_every_queued_write_within_their_timeout(self, timeout, chain):
        """Mutants: a deadline computed as now - timeout (no time at all), or a crash on timeout=None."""
        for how in ("flush", "close"):
            bg = SlowWrites()
            cache = chain(tiers=[InMemoryProgramCache(), (bg, TierPolicy("bg", write="background"))])
            for n in range(4):
                cache[b"%d" % n] = b"v"
            if how == "flush":
                assert cache.flush(timeout) is True
            else:
                cache.close(timeout)
            assert len(bg) == 4, how
            cache.close()


class TestByteCaps:
    """The default chain's byte caps reach the tier they bound, and no tier holds more."""

    def test_memory_byte_cap_reaches_the_memory_tier(self, tmp_path, chain):
        """max_memory_bytes=1000 and 400-byte entries: the memory tier keeps the two newest, and no more bytes."""
        cache = chain(tmp_path, max_memory_bytes=1000)
        for n in range(3):
            cache[b"m%d" % n] = bytes([n]) * 400
        memory = cache.tier("memory").resource
        assert [memory.get(b"m%d" % n) is not None for n in range(3)] == [False, True, True]
        assert cache.stats()["memory"].bytes_held == 800
        cache.close()

    def test_local_byte_cap_reaches_the_local_tier(self, tmp_path, chain):
        """max_local_bytes=1000 and 400-byte entries: the directory never holds more than 1000 bytes of entries."""
        cache = chain(tmp_path, max_local_bytes=1000)
        for n in range(5):
            cache[b"l%d" % n] = bytes([n]) * 400
        sizes = [entry.size for entry in LocalDir(tmp_path).iter_entries()]
        assert sum(sizes) <= 1000 and len(sizes) == 2
        assert cache.tier("local").lookup(b"l4") == bytes([4]) * 400  # the newest survives
        cache.close()


class TestDeleteAndClear:
    """A delete reaches every tier and names each that failed; clear() goes on past the tiers it must skip."""

    def test_delete_failed_names_every_failing_tier_and_chains_the_first_cause(self):
        memory = InMemoryProgramCache()
        cache = TieredProgramCache(
            tiers=[(memory, TierPolicy("memory")), (Broken("one"), TierPolicy("a")), (Broken("two"), TierPolicy("b"))]
        )
        cache[b"k"] = b"v"
        with pytest.raises(DeleteFailed) as raised:
            del cache[b"k"]
        assert str(raised.value) == "the entry may still be served: tier a: OSError: one; tier b: OSError: two"
        assert raised.value.tiers == ("a", "b")
        assert str(raised.value.__cause__) == "one"
        assert memory.get(b"k") is None  # the tier that could delete did
        assert (cache.stats()["a"].errors, cache.stats()["b"].errors) == (1, 1)

    @pytest.mark.parametrize("blocker", ["shared", "read_only"])
    def test_clear_goes_on_past_a_shared_or_read_only_tier(self, blocker):
        """Mutant: clear() stopping (break) at the first tier it must skip left later tiers full."""
        first, skipped, last = InMemoryProgramCache(), InMemoryProgramCache(), InMemoryProgramCache()
        policy = TierPolicy("skipped", shared=True) if blocker == "shared" else TierPolicy("skipped", read_only=True)
        cache = TieredProgramCache(tiers=[(first, TierPolicy("first")), (skipped, policy), (last, TierPolicy("last"))])
        for resource in (first, skipped, last):
            resource[b"k"] = b"v"
        cache.clear()
        assert (len(first), len(skipped), len(last)) == (0, 1, 0)

    def test_a_tier_that_fails_to_clear_or_close_is_counted_and_named(self, caplog):
        broken = Broken("stuck")
        cache = TieredProgramCache(tiers=[InMemoryProgramCache(), (broken, TierPolicy("broken"))])
        with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
            cache.clear()
            cache.close()
            cache.close()  # idempotent: the tier is closed once
        assert cache.stats()["broken"].errors == 1
        assert [r.getMessage() for r in caplog.records] == [
            "tier broken failed to clear: OSError('stuck')",
            "tier broken failed to close: OSError('stuck')",
        ]
        assert broken.closes == 1


class TestCounters:
    """stats() and len(): latencies in milliseconds, entries counted past the tiers that cannot count."""

    def test_latency_percentiles_are_in_milliseconds(self):
        """Mutant: a latency recorded in seconds (or tenths of ms) would be 1000x (10x) off."""
        slow = Slow()
        slow[b"k"] = b"v"
        cache = TieredProgramCache(tiers=[(InMemoryProgramCache(), TierPolicy("memory", promote=False)), (slow, TierPolicy("slow"))])
        for _ in range(3):
            assert cache.get(b"k") == b"v"
        p50 = cache.stats()["slow"].get_p50_ms
        assert 50 <= p50 < 500, p50

    def test_len_counts_past_a_shared_tier_and_survives_a_tier_that_cannot_count(self, caplog):
        local = InMemoryProgramCache()
        cache = TieredProgramCache(
            tiers=[
                (InMemoryProgramCache(), TierPolicy("memory", promote=False)),
                (InMemoryProgramCache(), TierPolicy("cluster", shared=True)),
                (Broken("no count"), TierPolicy("broken")),
                (local, TierPolicy("local")),
            ]
        )
        for n in range(3):
            local[b"%d" % n] = b"v"
        with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
            assert len(cache) == 3
        assert [r.getMessage() for r in caplog.records] == ["tier broken could not count its entries: OSError('no count')"]
        assert len(TieredProgramCache(tiers=[(InMemoryProgramCache(), TierPolicy("cluster", shared=True))])) == 0


class TestFailurePolicy:
    """What each exception a tier raises means: a counted miss or drop, with its own warning, never an error
    to the caller."""

    @pytest.mark.parametrize(("exc", "read_counter", "read_warning", "write_counter", "write_warning"), _FAULTS,
                             ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None)  # fmt: skip
    def test_each_fault_is_a_counted_miss_or_drop_with_its_own_warning(self, 
        caplog, exc, read_counter, read_warning, write_counter, write_warning
    ):
        source = InMemoryProgramCache()
        source[b"k"] = b"v"
        cache = TieredProgramCache(tiers=[(Faulty(exc), TierPolicy("t")), (source, TierPolicy("source"))])
        with caplog.at_level(logging.DEBUG, logger="tiered_progcache.chain.tier"):
            assert cache.get(b"k") == b"v"  # a miss in t, a hit below, promoted into t: the write fails too
        stats = cache.stats()["t"]
        counted = {f: getattr(stats, f) for f in ("misses", "rejected", "skipped", "timeouts", "errors", "promotions")}
        expected = dict.fromkeys(counted, 0) | {"misses": 1}
        expected[read_counter] += 1
        expected[write_counter] += 1
        assert counted == expected  # a failed promotion is not counted as one
        assert stats.writes == 0 and stats.get_p50_ms is not None and stats.get_p50_ms < 1000
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [w for w in (read_warning, write_warning) if w is not None]
        if isinstance(exc, KeyError):
            return  # an EntryRejected on delete is a KeyError: "not held here"
        before = getattr(cache.stats()["t"], write_counter)
        with pytest.raises(DeleteFailed):
            del cache[b"k"]
        assert getattr(cache.stats()["t"], write_counter) == before + 1

    def test_a_failing_first_tier_on_the_fast_path_is_a_counted_miss_and_default_is_returned(self, caplog):
        first = Broken("flaky")
        first[b"warm"] = b"w"
        cache = TieredProgramCache(tiers=[(first, TierPolicy("memory")), InMemoryProgramCache()])
        assert cache.get(b"warm") == b"w"  # one hit: the next lookup takes the untimed fast path
        first.reads = True
        with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
            assert cache.get(b"warm", b"fallback") == b"fallback"
        assert cache.stats()["memory"].errors == 1
        assert [r.getMessage() for r in caplog.records] == [
            "tier memory failed a read (counted as a miss): OSError('flaky')"
        ]


class TestConstruction:
    """The default chain hands every setting to the tier it shapes; a bad tier or argument is refused by name."""

    def test_every_remote_setting_reaches_the_remote_tier(self, tmp_path):
        pytest.importorskip("zstandard")  # compression="zstd" needs it (the test extra has it; the GPU host not)
        url = f"file://{tmp_path / 'remote'}"
        (tmp_path / "remote").mkdir()  # a missing file:// root is an error, not created
        with TieredProgramCache(
            tmp_path / "local", remote=url, signing_key=b"k" * 32, compression="zstd", remote_timeout=2.5
        ) as cache:
            remote = cache.shared_store
            assert (remote.url, remote.timeout, remote.read_only) == (url, 2.5, False)
            cache[b"big"] = b"a" * 100_000
            assert cache.flush(30) is True
        stored = RemoteProgramCache.from_url(url, signing_key=b"k" * 32)
        assert stored.read_entry(entry_name(b"big")) == b"a" * 100_000  # signed with the key given
        assert RemoteProgramCache.from_url(url, signing_key=b"x" * 32).verify_entry(entry_name(b"big")).startswith(
            "bad signature"
        )
        assert max(e.size for e in stored.iter_entries()) < 10_000  # zstd-compressed
        with TieredProgramCache(tmp_path / "local", remote=url, remote_read_only=True) as reader:
            assert reader.shared_store.read_only is True
            assert reader.tier("remote").writeback is None

    def test_strict_reaches_the_remote_tier(self, tmp_path):
        blocker = tmp_path / "a-file"
        blocker.write_bytes(b"")
        with pytest.raises(OSError):
            TieredProgramCache(tmp_path / "local", remote=f"file://{blocker}/remote", strict=True)
        with TieredProgramCache(tmp_path / "local", remote=f"file://{blocker}/remote") as lenient:
            assert lenient.tier("remote") is not None

    def test_a_signing_key_file_is_read_even_without_a_remote(self, tmp_path):
        with pytest.raises(ValueError, match="^signing_key_file: cannot read the signing key file"):
            TieredProgramCache(tmp_path, signing_key_file=tmp_path / "missing.key")

    def test_argument_errors_name_what_was_given(self, tmp_path):
        with pytest.raises(TypeError, match="^path and local_dir are one setting: give it once$"):
            TieredProgramCache(tmp_path, local_dir=tmp_path)
        with pytest.raises(ValueError, match=r"^pass either tiers=\[...\] or the settings that build the default chain \(path\), not both$"):
            TieredProgramCache(tmp_path, tiers=[InMemoryProgramCache()])
        with pytest.raises(ValueError, match=r"\(local_dir, strict\)"):
            TieredProgramCache(local_dir=tmp_path, strict=True, tiers=[InMemoryProgramCache()])
        with pytest.raises(ValueError, match="^tiers must name at least one tier$"):
            TieredProgramCache(tiers=[])
        local = TieredProgramCache(tiers=[FileStreamProgramCache(tmp_path)])
        assert [t.name for t in local.tiers] == ["local"]

    def test_tier_specs_are_checked_and_named(self):
        plain = InMemoryProgramCache()
        with pytest.raises(TypeError, match=r"^a tier given as a tuple must be \(ProgramCacheResource or EntryStore, TierPolicy\)$"):
            TieredProgramCache(tiers=[(plain, "not a policy")])
        with pytest.raises(TypeError, match=r"^a tier given as a tuple must be \(ProgramCacheResource or EntryStore, TierPolicy\)$"):
            TieredProgramCache(tiers=[(plain, TierPolicy("a"), "extra")])
        with pytest.raises(TypeError, match=r"^tier 1 must be a cuda.core.utils.ProgramCacheResource or a "
                                        r"tiered_progcache EntryStore, got dict$"):
            TieredProgramCache(tiers=[plain, {}])
        cache = TieredProgramCache(tiers=[InMemoryProgramCache(), InMemoryProgramCache()])
        assert [t.name for t in cache.tiers] == ["memory", "memory2"]
        unnamed = TieredProgramCache(tiers=[InMemoryProgramCache(), _Custom(), _Custom()])
        assert [t.name for t in unnamed.tiers] == ["memory", "tier1", "tier2"]
        assert unnamed.tier("tier1").policy == TierPolicy("tier1")  # not shared, not background: not an entry store
        with pytest.raises(KeyError, match=r"no tier named 'nope'; tiers are \['memory', 'tier1', 'tier2'\]"):
            unnamed.tier("nope")
