"""The boot fetch (chain/bootfetch.py): a fresh node's first shared lookup also brings the newest entries, once.

Counted by the in-memory ``SlowFileSystem`` (requests by operation) and a ``file://`` remote
(the tier's own counters); a listing that fails or hangs is a ``SlowFileSystem`` whose
``_find`` raises or waits on an event the test sets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from typing import Any

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.chain.bootfetch import MAX_LISTED, boot_fetch_for, newest_within
from tiered_progcache.chain.stats import MetadataKey
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import StoredEntry, entry_name
from tiered_progcache.testing.slowfs import SlowFileSystem

from test_singleflight import kernel, options

K = 6
KEYS = [b"boot-%d" % n for n in range(K)]


def _payload(key: bytes, size: int = 100) -> bytes:
    return (b"cubin:" + key * size)[:size]  # bytes of no code-object format: a local read passes them


def _join_boot_fetch() -> None:
    for fetcher in [t for t in threading.enumerate() if t.name == "tiered-progcache-boot-fetch"]:
        fetcher.join(60)
        assert not fetcher.is_alive()


@pytest.fixture
def release():
    """The event that lets a hanging batch or listing go; set at teardown, and the boot fetch joined."""
    event = threading.Event()
    yield event
    event.set()
    _join_boot_fetch()


def _store(fs: SlowFileSystem, sizes: list[int] | None = None, timeout: float | None = None,
           breaker: CircuitBreaker | None = None) -> RemoteProgramCache:
    """K entries, entry n written n seconds after entry 0 (the newest last)."""
    fs.mkdir("bucket")
    remote = RemoteProgramCache(fs, "bucket/kernels", timeout=timeout, breaker=breaker)
    for n, key in enumerate(KEYS):
        remote.write_key(key, _payload(key, (sizes or [100] * K)[n]))
        path = fs._strip_protocol(remote.path_for(entry_name(key)))
        fs.objects[path] = (fs.objects[path][0], 1_000_000.0 + n)
    fs.requests.clear()
    return remote


def _chain(local: Any, remote: RemoteProgramCache, **settings: Any) -> TieredProgramCache:
    return TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(local), remote], **settings)


def test_a_fresh_node_reads_k_entries_in_one_listing_one_batch_and_the_first_lookup(tmp_path):
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        assert cache.get(KEYS[0]) == _payload(KEYS[0])  # the trigger: its own GET, the fetch beside it
        for key in KEYS[1:]:
            assert cache.get(key) == _payload(key)  # waits for the batch, then reads the local directory
        _join_boot_fetch()
        assert dict(fs.requests) == {"get": 1 + (K - 1), "list": 1}
        stats = cache.stats()
        assert (stats["remote"].hits, stats["remote"].misses, stats["local"].hits) == (1, 0, K - 1)
        assert {e.name for e in LocalDir(tmp_path / "node").iter_entries()} == {entry_name(k) for k in KEYS}
        local_misses = stats["local"].misses
        assert cache.get(b"absent") is None and fs.requests["get"] == K + 1  # a name not in the batch: as before
        assert cache.stats()["local"].misses == local_misses + 1  # ... and the local directory asked once, not twice
        assert cache._boot.report[0] == K


def test_an_entry_read_ahead_before_the_pick_is_read_once_not_again_in_the_batch(tmp_path):
    """A direct-mode hit reads its entry ahead while the fetch lists: the batch leaves that entry out, as it
    leaves out the trigger's, so each entry is read from the store exactly once."""
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        cache.read_ahead(KEYS[1])  # before the first shared lookup: the fetch has not listed yet
        assert cache.get(KEYS[0]) == _payload(KEYS[0])  # the trigger
        _join_boot_fetch()
        assert cache._boot._batch == frozenset(entry_name(key) for key in KEYS[2:])
        for key in KEYS[1:]:
            assert cache.get(key) == _payload(key)
        assert dict(fs.requests) == {"get": K, "list": 1}
        assert cache.stats()["remote"].hits == 2  # the trigger's and the read ahead's; the batch's are local hits
        cache.read_ahead(b"read ahead after the pick")
        assert cache._boot._asked == set()  # kept for the pick only: a long-running process does not grow it


def _with_direct_manifest(fs: SlowFileSystem, remote: RemoteProgramCache) -> MetadataKey:
    """A direct manifest's key beside the K entries (stored under its own name), the request counts cleared."""
    remote.write_key(DIRECT, _payload(DIRECT))
    fs.requests.clear()
    return MetadataKey(DIRECT)


DIRECT = b"boot-direct-manifest"


def test_a_metadata_read_is_a_fresh_nodes_first_shared_lookup_too(tmp_path):
    """Direct mode's first read is a direct manifest (metadata, promoted into the local directory): it starts the
    fetch while the directory is still empty. The batch lands once an entry's lookup comes (its kernel has its
    key), and that lookup and the later ones read the batch locally."""
    fs = SlowFileSystem()
    remote = _store(fs)
    manifest = _with_direct_manifest(fs, remote)
    with _chain(tmp_path / "node", remote) as cache:
        assert cache.get(manifest) == _payload(DIRECT)  # the trigger
        assert not cache._boot._go.is_set()  # nothing lands while the kernel hashes its headers
        for key in KEYS:
            assert cache.get(key) == _payload(key)  # the first lets the batch land; each then reads it locally
        _join_boot_fetch()
        assert dict(fs.requests) == {"get": 1 + K, "list": 1}
        stats = cache.stats()
        assert (stats["remote"].hits, stats["remote"].misses, stats["local"].hits) == (0, 0, K)


class _GateSeen(threading.Event):
    """The fetch's landing gate, telling the test when the fetching thread waits at it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()
        self.timeouts: list[float | None] = []  # how long each wait at it was allowed to last

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        self.waiting.set()
        return super().wait(timeout)


def test_after_a_metadata_read_the_store_is_listed_and_nothing_read_until_an_entrys_lookup(tmp_path):
    """While the first kernel hashes its headers the fetch has listed and waits: no entry of the batch read,
    none written locally (the batch's verifying and writing is most of the fetch's CPU)."""
    fs = SlowFileSystem()
    remote = _store(fs)
    manifest = _with_direct_manifest(fs, remote)
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._go = gate = _GateSeen()
        assert cache.get(manifest) == _payload(DIRECT)
        assert gate.waiting.wait(60)  # the fetching thread is at the gate, the listing done
        assert dict(fs.requests) == {"get": 1, "list": 1}
        assert not cache._boot._listed.is_set()  # not even picked: a read ahead now is still left out
        assert {e.name for e in LocalDir(tmp_path / "node").iter_entries()} == {entry_name(DIRECT)}
        assert cache.get(KEYS[0]) == _payload(KEYS[0])
        _join_boot_fetch()
        assert cache._boot.report[1].entries == K
        assert dict(fs.requests) == {"get": 1 + K, "list": 1}


def test_a_metadata_read_after_the_trigger_lets_the_batch_land_instead_of_waiting_for_an_entrys_lookup(tmp_path):
    """A heavy kernel no node recorded: its direct manifest is on no tier (the trigger), and its flight reads its
    entry as metadata (the look under the lease, a waiter's polls), so no entry's lookup comes. That read lets the
    batch land and takes it from there; it does not wait a request deadline at the gate's side (the deadline
    here is an hour: only the batch's landing can end the read)."""
    fs = SlowFileSystem()
    remote = _store(fs, timeout=3600.0)
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._go = gate = _GateSeen()
        assert cache.get(MetadataKey(DIRECT)) is None  # the trigger: no direct manifest
        assert gate.waiting.wait(60)  # listed; the batch waits at the gate
        got: list[bytes | None] = []
        reader = threading.Thread(target=lambda: got.append(cache.get(MetadataKey(KEYS[0]))), daemon=True)
        reader.start()
        reader.join(60)
        read_without_the_gate = not reader.is_alive()
        gate.set()  # lets a reader that waits at the gate's side (the defect) go: the test then fails, not hangs
        reader.join(60)
        assert read_without_the_gate and got == [_payload(KEYS[0])]
        assert gate.timeouts == [3600.0]
        _join_boot_fetch()
        assert dict(fs.requests) == {"get": 1 + K, "list": 1}  # the trigger's miss, then the batch: read once


def test_an_entry_read_ahead_lets_the_batch_land_when_its_lookup_takes_it(tmp_path):
    """A direct-mode hit: its manifest (the fetch lists), its entry read ahead while it hashes (nothing lands,
    nothing is picked), then the lookup that takes the read-ahead entry lets the batch be picked and land,
    without that entry: each entry is read from the store exactly once."""
    fs = SlowFileSystem()
    remote = _store(fs)
    manifest = _with_direct_manifest(fs, remote)
    with _chain(tmp_path / "node", remote) as cache:
        assert cache.get(manifest) == _payload(DIRECT)
        cache.read_ahead(KEYS[0])
        assert not cache._boot._go.is_set() and not cache._boot._listed.is_set()
        assert cache.get(KEYS[0]) == _payload(KEYS[0])  # taken from the read ahead
        assert cache._boot._go.is_set()
        _join_boot_fetch()
        assert cache._boot._batch == frozenset(entry_name(key) for key in KEYS[1:])
        for key in KEYS[1:]:
            assert cache.get(key) == _payload(key)
        assert dict(fs.requests) == {"get": 2 + (K - 1), "list": 1}
        assert cache.stats()["remote"].hits == 1  # the read-ahead one; the batch's are local hits


def test_an_entry_read_ahead_taken_by_the_first_shared_lookup_starts_the_fetch(tmp_path):
    """No metadata read before: the lookup that takes the read-ahead entry is the chain's first at the shared
    tier, and starts the fetch as any first lookup does (that entry left out of the batch)."""
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        cache.read_ahead(KEYS[0])
        assert cache.get(KEYS[0]) == _payload(KEYS[0])  # taken from the read ahead
        _join_boot_fetch()
        assert cache._boot.report is not None
        assert cache._boot._batch == frozenset(entry_name(key) for key in KEYS[1:])
        for key in KEYS[1:]:
            assert cache.get(key) == _payload(key)
        assert dict(fs.requests) == {"get": K, "list": 1}


def test_a_batch_no_entry_lookup_lets_land_lands_one_request_deadline_on(tmp_path):
    """Metadata reads alone (no kernel asks for its entry): the batch still lands, one request deadline on."""
    fs = SlowFileSystem()
    remote = _store(fs, timeout=0.5)
    manifest = _with_direct_manifest(fs, remote)
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._go = gate = _GateSeen()
        assert cache.get(manifest) == _payload(DIRECT)
        _join_boot_fetch()
        assert gate.timeouts == [0.5]  # the store's request deadline, the bound the docs state
        assert not gate.is_set() and cache._boot.report[1].entries == K
        for key in KEYS:
            assert cache.get(MetadataKey(key)) == _payload(key)
        assert dict(fs.requests) == {"get": 1 + K, "list": 1}


def test_the_trigger_asks_the_local_directory_once(tmp_path):
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        assert cache.get(KEYS[0]) == _payload(KEYS[0])
        assert cache.stats()["local"].misses == 1  # the fetch it started has brought nothing yet
        _join_boot_fetch()


def test_the_fetch_is_logged_with_what_it_took(tmp_path, caplog):
    fs = SlowFileSystem()
    remote = _store(fs)
    with caplog.at_level(logging.INFO, "tiered_progcache.chain.bootfetch"):
        with _chain(tmp_path / "node", remote) as cache:
            assert cache._boot.report is None  # nothing done before the first lookup
            cache.get(KEYS[0])
            _join_boot_fetch()
    [line] = [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.chain.bootfetch"]
    assert re.fullmatch(rf"boot fetch from {re.escape(remote.location)}: {K - 1} of {K} listed entries in "
                        r"\d+\.\d{3} s", line), line  # fmt: skip
    assert float(line.rsplit(" ", 2)[1]) < 600


def test_a_listing_is_read_to_max_listed_entries_at_most(tmp_path, monkeypatch):
    from tiered_progcache.chain import bootfetch

    monkeypatch.setattr(bootfetch, "MAX_LISTED", 3)
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        cache.get(KEYS[0])
        _join_boot_fetch()
        assert cache._boot.report[0] == 3


def test_a_budget_that_fits_nothing_fetches_nothing_but_still_lists(tmp_path):
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote, boot_fetch_bytes=1) as cache:  # 1 byte: on, and nothing fits
        assert cache.get(KEYS[0]) == _payload(KEYS[0])
        _join_boot_fetch()
        assert dict(fs.requests) == {"get": 1, "list": 1}
        assert cache._boot.report == (K, None)


def test_a_local_directory_that_cannot_be_listed_is_one_warning_and_no_fetch(tmp_path, caplog, monkeypatch):
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        def unlistable():  # a failing local disk: the root user reads any directory, so the failure is injected
            raise OSError("disk gone")

        monkeypatch.setattr(cache._boot._local, "iter_entries", unlistable)
        with caplog.at_level(logging.WARNING, "tiered_progcache.chain.bootfetch"):
            for key in KEYS:
                assert cache.get(key) == _payload(key)
        assert dict(fs.requests) == {"get": K}
    [line] = [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.chain.bootfetch"]
    assert line == f"boot fetch into {cache._boot._local.location} skipped: OSError: disk gone"


def test_compile_on_a_fresh_node_against_a_warm_file_store_asks_the_store_once(tmp_path, events):
    url = (tmp_path / "remote").as_uri()
    (tmp_path / "remote").mkdir()
    with TieredProgramCache(tmp_path / "ci", remote=url) as ci:
        for i in range(K):
            tpc.compile(kernel(600 + i), "c++", options(), cache=ci)
        assert ci.flush(60)
    ran = len(events)
    with TieredProgramCache(tmp_path / "node", remote=url, lease_min_compile_rtts=0.0) as node:
        for i in range(K):
            tpc.compile(kernel(600 + i), "c++", options(), cache=node)
        _join_boot_fetch()
        stats = node.stats()
        assert (stats["remote"].hits, stats["remote"].misses) == (1, 0)  # the trigger; the rest came in the batch
        assert stats["local"].hits == K - 1 and len(events) == ran


def test_a_local_directory_that_holds_an_entry_never_fetches(tmp_path):
    fs = SlowFileSystem()
    remote = _store(fs)
    LocalDir(tmp_path / "node").write_entry(entry_name(b"here"), b"cubin:here")
    others = set(threading.enumerate())
    with _chain(tmp_path / "node", remote) as cache:
        for key in KEYS:
            assert cache.get(key) == _payload(key)
        assert not [t for t in threading.enumerate() if t.name == "tiered-progcache-boot-fetch" and t not in others]
        assert dict(fs.requests) == {"get": K}


def test_zero_turns_it_off(tmp_path):
    fs = SlowFileSystem()
    remote = _store(fs)
    with _chain(tmp_path / "node", remote, boot_fetch_bytes=0) as cache:
        for key in KEYS:
            assert cache.get(key) == _payload(key)
        assert dict(fs.requests) == {"get": K}


def test_the_byte_budget_takes_exactly_the_newest_entries_whose_stored_sizes_fit(tmp_path):
    fs = SlowFileSystem()
    remote = _store(fs, sizes=[100, 200, 300, 400, 500, 600])
    stored = {e.name: e.size for e in remote.iter_entries()}  # envelopes: payload and header
    newest3 = [entry_name(k) for k in KEYS[3:]]
    budget = sum(stored[name] for name in newest3)
    for given, expected in [(budget, newest3), (budget - 1, newest3[1:])]:
        fs.requests.clear()
        with _chain(tmp_path / f"node-{given}", remote, boot_fetch_bytes=given) as cache:
            assert cache.get(b"absent") is None  # a trigger the store does not hold
            _join_boot_fetch()
            assert {e.name for e in LocalDir(tmp_path / f"node-{given}").iter_entries()} == set(expected)
            assert dict(fs.requests) == {"get": 1 + len(expected), "list": 1}


def test_the_local_cap_bounds_the_budget_and_the_pick_leaves_manifests_and_the_trigger_behind():
    from tiered_progcache.compiling.manifest import manifest_name

    a, b, c = (entry_name(x) for x in (b"a", b"b", b"c"))
    listed = [StoredEntry(a, 10, 3.0), StoredEntry(manifest_name(a), 1, 4.0), StoredEntry(b, 10, 2.0),
              StoredEntry(c, 10, None)]
    assert newest_within(listed, 10**300) == [a, b, c]  # any int budget is safe: the listing bounds it
    assert newest_within(listed, 20, leave_out={a}) == [b, c]
    assert newest_within(listed, 20, leave_out=(a, c)) == [b]
    assert newest_within(listed, 19) == [a]
    local, remote = LocalDir("/nonexistent"), RemoteProgramCache(SlowFileSystem(), "bucket/x")
    assert boot_fetch_for(local, remote, 100, 50, 1)._max_bytes == 50
    assert boot_fetch_for(local, remote, 0, None, 1) is None and boot_fetch_for(None, remote, 100, None, 1) is None
    assert MAX_LISTED == 10_000


class _FailingListing(SlowFileSystem):
    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        self.requests["list"] += 1
        raise PermissionError("listing refused")


def test_a_failing_listing_costs_only_itself_and_is_logged_once(tmp_path, caplog):
    fs = _FailingListing()
    remote = _store(fs)
    with caplog.at_level(logging.WARNING, "tiered_progcache.chain.bootfetch"):
        with _chain(tmp_path / "node", remote) as cache:
            for key in KEYS:
                assert cache.get(key) == _payload(key)
            _join_boot_fetch()
            assert dict(fs.requests) == {"get": K, "list": 1}
    logged = [r for r in caplog.records if r.name == "tiered_progcache.chain.bootfetch"]
    assert [r.getMessage() for r in logged] == [
        f"boot fetch from {remote.location} failed (lookups go to the store as before): PermissionError: listing refused"]


class _HangingListing(SlowFileSystem):
    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        self.requests["list"] += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return {}


class _CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.timed_out = 0
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        done = super().wait(timeout)
        self.timed_out += not done
        return done


class _HangingBatch(SlowFileSystem):
    """The boot fetch's GETs (the first GET of each of ``KEYS[1:]``) hang until released."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release
        self.hung = {f"{name[:2]}/{name[2:]}" for name in map(entry_name, KEYS[1:])}
        self.asked: set[str] = set()
        self.held = 0
        self.all_asked = threading.Event()  # set once every hung GET was asked: the batch is out, all held

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        first = path not in self.asked
        self.asked.add(path)
        if first and path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1] in self.hung:
            self.held += 1
            if self.held == len(self.hung):
                self.all_asked.set()
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        return await super()._cat_file(path, start, end, **kwargs)


def test_a_hanging_batch_holds_one_lookup_at_most_the_store_deadline_and_no_other(tmp_path, release):
    fs = _HangingBatch(release)
    # The batch's deadline passes while the lookups run, and each of its timed-out reads counts
    # against the breaker: one that never opens keeps the answers independent of that race.
    remote = _store(fs, timeout=0.2, breaker=CircuitBreaker(failure_threshold=10**6))
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._done = done = _CountingEvent()
        assert cache.get(KEYS[0]) == _payload(KEYS[0])  # the trigger: answered; the batch's GETs hang
        assert cache._boot._listed.wait(60)  # the batch's names are known: the next lookups wait on the batch
        assert fs.all_asked.wait(60)  # and its GETs are out and held (so no lookup's own GET is the one that hangs)
        assert cache.get(b"absent") is None  # not in the batch: no wait, the local directory asked once
        assert (done.timeouts, cache.stats()["local"].misses) == ([], 2)
        answers = [cache.get(key) for key in KEYS[1:]]
        assert answers == [_payload(key) for key in KEYS[1:]]  # each from the store, as before
        assert done.timed_out == 1 and len(done.timeouts) == 1  # the first waited the deadline out, no other
        assert 0 < done.timeouts[0] <= 0.2
        stats = cache.stats()
        assert (stats["remote"].hits, stats["local"].misses) == (K, K + 1)  # the local directory asked once each


def test_a_forked_child_does_not_wait_for_its_parents_fetch(tmp_path, release):
    fs = _HangingBatch(release)
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._done = done = _CountingEvent()
        cache._boot._listed = listed = _CountingEvent()
        assert cache.get(KEYS[0]) == _payload(KEYS[0])
        assert fs.all_asked.wait(60)  # the batch is out and held (else the lookup's GET could be the one that hangs)
        cache._boot._pid = -1  # as in a child forked after the fetch started: the fetching thread is the parent's
        assert cache.get(KEYS[1]) == _payload(KEYS[1])  # from the store, at once
        assert (done.timeouts, listed.timeouts) == ([], [])
        assert cache.stats()["local"].misses == 2  # the local directory asked once for each lookup


def test_a_hanging_listing_holds_one_lookup_at_most_the_store_deadline_and_no_other(tmp_path, release):
    fs = _HangingListing(release)
    remote = _store(fs, timeout=0.2)  # a listing gets MIN_LIST_TIMEOUT_S; a waiting lookup only this
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._listed = listed = _CountingEvent()
        answers: list[bytes | None] = []
        looker = threading.Thread(target=lambda: answers.extend(cache.get(key) for key in KEYS))
        looker.start()
        looker.join(60)
        assert not looker.is_alive() and answers == [_payload(key) for key in KEYS]
        assert dict(fs.requests) == {"get": K, "list": 1}  # each lookup went to the store, as before
        assert listed.timed_out == 1  # the second lookup waited the deadline out; the others did not wait
        assert listed.timeouts == [0.2]  # the store's request deadline
        assert cache.stats()["local"].misses == K  # once per lookup: one that gave up did not look again
        assert all(t.daemon for t in threading.enumerate() if t.name == "tiered-progcache-boot-fetch")


@pytest.mark.parametrize("value, error", [(float("inf"), TypeError), (1e300, TypeError), (True, TypeError),
                                          (-1, ValueError), ("1G", TypeError)])
def test_the_setting_refuses_what_is_not_a_byte_count(tmp_path, value, error):
    with pytest.raises(error, match="boot_fetch_bytes"):
        TieredProgramCache(tmp_path, boot_fetch_bytes=value)


@pytest.mark.parametrize("text, expected", [("0", 0), ("off", 0), ("1G", 10**9), ("64Mi", 64 << 20)])
def test_the_variable_reads_sizes_and_off(text, expected):
    from tiered_progcache.configvalues import ConfigValues

    assert ConfigValues.from_env({"TIERED_PROGCACHE_BOOT_FETCH_BYTES": text}).boot_fetch_bytes == expected


@pytest.mark.parametrize("text", ["1e300", "inf", "9" * 400, "-1", "lots"])
def test_the_variable_refuses_what_is_not_a_size(text):
    from tiered_progcache.configvalues import ConfigValues

    with pytest.raises(ValueError, match="TIERED_PROGCACHE_BOOT_FETCH_BYTES"):
        ConfigValues.from_env({"TIERED_PROGCACHE_BOOT_FETCH_BYTES": text})


def test_a_store_that_states_no_deadline_is_waited_for_at_most_the_settings_default(tmp_path, release, monkeypatch):
    from tiered_progcache.chain import bootfetch
    from tiered_progcache.testing.wrapper import WrapperEntryStore

    class NoDeadline(WrapperEntryStore):
        @property
        def request_timeout_s(self) -> None:
            return None

    monkeypatch.setattr(bootfetch, "DEFAULT_REMOTE_TIMEOUT_S", 0.2)
    fs = _HangingListing(release)
    remote = NoDeadline(_store(fs))
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._listed = listed = _CountingEvent()
        looker = threading.Thread(target=lambda: [cache.get(key) for key in KEYS])
        looker.start()
        looker.join(60)
        assert not looker.is_alive() and listed.timed_out == 1


def test_a_store_down_at_construction_is_one_warning_and_no_fetch(tmp_path, caplog):
    """One fault, one message: the constructor's warning says the store is down; the boot fetch neither lists
    nor warns again (its breaker is open, so it could only fail with the same fault)."""
    import socket

    with socket.socket() as refused:
        refused.bind(("127.0.0.1", 0))  # bound, never listening: every connect is refused
        with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
            cache = TieredProgramCache(tmp_path / "node", remote=f"redis://127.0.0.1:{refused.getsockname()[1]}/0",
                                       remote_timeout=1)  # fmt: skip
            try:
                assert cache.get(b"k" * 32) is None
                _join_boot_fetch()
            finally:
                cache.close(timeout=5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "is unreachable" in warnings[0], warnings


class _ReleasingEvent(threading.Event):
    """Holds the batch until a lookup waits for it: that lookup has missed locally and takes the batch's branch."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def wait(self, timeout: float | None = None) -> bool:
        self.release.set()
        return super().wait(60)


def test_an_entry_the_batch_brought_after_the_local_miss_is_promoted_into_memory(tmp_path, release):
    fs = _HangingBatch(release)
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._done = _ReleasingEvent(release)
        assert cache.get(KEYS[0]) == _payload(KEYS[0])  # the trigger
        assert cache._boot._listed.wait(60)
        before = cache.stats()
        assert cache.get(KEYS[1]) == _payload(KEYS[1])  # missed locally, waited, read what the batch brought
        delta = cache.stats() - before
        assert (delta["local"].misses, delta["local"].hits, delta["remote"].lookups) == (1, 1, 0)
        before = cache.stats()
        assert cache.get(KEYS[1]) == _payload(KEYS[1])
        delta = cache.stats() - before
        assert (delta["memory"].hits, delta["local"].lookups) == (1, 0)  # promoted: memory answers now


def test_a_lookup_read_ahead_does_not_wait_for_the_batch(tmp_path, release):
    fs = _HangingBatch(release)
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._done = done = _CountingEvent()
        assert cache.get(KEYS[0]) == _payload(KEYS[0])  # the trigger
        assert fs.all_asked.wait(60)  # the batch's GETs are all out, and held
        cache.read_ahead(KEYS[1])  # its GET is the second of that entry's: answered
        assert cache.get(KEYS[1]) == _payload(KEYS[1])
        assert done.timeouts == []  # taken from the read ahead: the batch was never waited for
        assert cache.stats()["remote"].hits == 2


def test_a_metadata_read_memory_answers_never_waits_for_the_batch(tmp_path, release):
    fs = _HangingBatch(release)
    remote = _store(fs)
    with _chain(tmp_path / "node", remote) as cache:
        cache._boot._done = done = _CountingEvent()
        cache._boot._listed = listed = _CountingEvent()
        cache.tier("memory").backend.write_key(KEYS[1], b"in memory")  # the local directory stays empty
        assert cache.get(MetadataKey(KEYS[0])) == _payload(KEYS[0])  # the trigger; the batch's GETs hang
        assert cache.get(MetadataKey(KEYS[1])) == b"in memory"
        assert (done.timeouts, listed.timeouts) == ([], [])  # asked of the boot fetch only at the shared tier


def test_a_chain_with_no_boot_fetch_reads_metadata_from_its_shared_tier(tmp_path):
    fs = SlowFileSystem()
    remote = _store(fs)
    with TieredProgramCache(tiers=[InMemoryProgramCache(), remote]) as cache:  # no local directory: no boot fetch
        assert cache.get(MetadataKey(KEYS[0])) == _payload(KEYS[0])
        assert dict(fs.requests) == {"get": 1}


def test_an_upload_queued_for_an_entry_the_batch_brought_is_forgone_when_a_shared_lookup_reads_it(tmp_path):
    """The batch read the entry from the shared tier, so that tier holds it: a race's shared lookup answered by
    the batch drops the node's queued uploads of the entry and its manifest there; neither is sent."""
    from tiered_progcache.compiling.manifest import manifest_key

    fs = SlowFileSystem()
    remote = _store(fs)
    gate = threading.Event()
    with _chain(tmp_path / "node", remote) as cache:
        try:
            assert cache.get(KEYS[0], where="shared") == _payload(KEYS[0])  # the trigger
            _join_boot_fetch()
            fs.write_gate = gate
            fs.writes_started.clear()  # set by the writes above: the wait below is for the filler's upload
            cache.put(b"filler", _payload(b"filler"))  # its upload held under way: the next ones queue
            assert fs.writes_started.wait(60)
            cache.put(manifest_key(KEYS[1]), b"{}")  # what a compile that won the race stores, manifest first
            cache.put(KEYS[1], _payload(KEYS[1]))
            before = cache.stats()["remote"]
            assert cache.get(KEYS[1], where="shared") == _payload(KEYS[1])  # the race's lookup, answered by the batch
            remote_stats = cache.stats()["remote"]
            assert remote_stats.forgone - before.forgone == 2 and remote_stats.lookups == before.lookups
        finally:
            gate.set()
        assert cache.flush(60)
        assert fs.requests["put"] == 1 and cache.stats()["remote"].writes == 1  # the filler's upload alone


def test_a_manifest_queued_behind_this_nodes_own_upload_of_its_entry_still_goes_up(tmp_path):
    """compile() uploads the binary before its manifest. A lookup that reads the binary while this node's own upload
    of it is under way forgoes nothing: the manifest queued behind it is this entry's, and nobody else's is coming."""
    from tiered_progcache.compiling.manifest import manifest_key

    fs = SlowFileSystem()
    remote = _store(fs)
    key = b"own-entry"
    remote.write_key(key, _payload(key))  # what this node's upload, under way below, is writing
    gate = threading.Event()
    with _chain(tmp_path / "node", remote, boot_fetch_bytes=0) as cache:
        try:
            fs.write_gate = gate
            fs.writes_started.clear()  # set by the writes above: the wait below is for this node's upload
            cache.put(key, _payload(key))  # this node's upload of the entry: under way, held
            assert fs.writes_started.wait(60)
            cache.put(manifest_key(key), b"{}")  # queued behind it
            assert cache.get(key, where="shared") == _payload(key)
            assert cache.stats()["remote"].forgone == 0
        finally:
            gate.set()
        assert cache.flush(60)
    assert remote.read_key(manifest_key(key)) == b"{}"


def test_an_entry_the_batch_brought_is_read_from_a_shared_tier_that_writes_synchronously_too(tmp_path):
    """A shared tier with no upload queue (``write="sync"``) has nothing to forgo: its batch's entries read as any."""
    from tiered_progcache.chain.policy import TierPolicy

    fs = SlowFileSystem()
    remote = _store(fs)
    tiers = [InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "node"),
             (remote, TierPolicy("remote", write="sync", shared=True))]
    with TieredProgramCache(tiers=tiers) as cache:
        assert cache.get(KEYS[0], where="shared") == _payload(KEYS[0])  # the trigger
        _join_boot_fetch()
        assert cache.get(KEYS[1], where="shared") == _payload(KEYS[1])  # the batch's, as a shared lookup
        assert cache.stats()["remote"].forgone == 0


def test_a_first_tier_with_an_upload_queue_forgoes_on_its_untimed_hits_too():
    """The chain's first tier counts most hits on a fast path (one in 64 timed); a hit there drops its queued
    uploads of the entry as a timed one does (a chain of one shared tier, written in the background)."""
    from tiered_progcache.chain.policy import TierPolicy
    from tiered_progcache.compiling.manifest import manifest_key

    fs = SlowFileSystem()
    remote = _store(fs)
    gate = threading.Event()
    with TieredProgramCache(tiers=[(remote, TierPolicy("remote", write="background", shared=True))]) as cache:
        try:
            assert cache.get(KEYS[0]) == _payload(KEYS[0])  # the first hit: timed; the next ones take the fast path
            fs.write_gate = gate
            fs.writes_started.clear()  # set by the writes above: the wait below is for the filler's upload
            cache.put(b"filler", _payload(b"filler"))  # its upload held under way: the next ones queue
            assert fs.writes_started.wait(60)
            cache.put(manifest_key(KEYS[1]), b"{}")
            cache.put(KEYS[1], _payload(KEYS[1]))
            assert cache.get(KEYS[1]) == _payload(KEYS[1])  # an untimed hit
            assert cache.stats()["remote"].forgone == 2
        finally:
            gate.set()
        assert cache.flush(60)
        assert fs.requests["put"] == 1  # the filler's upload alone


#: A request deadline no held read reaches: what ends a hold in the tests below is the release alone.
HELD_S = 120.0


def test_close_before_the_batch_begins_reads_nothing_more_and_ends_the_fetch_quietly(tmp_path, caplog):
    """A process that takes one hit and closes: the fetch waiting at the gate (listed, nothing read) never reads."""
    fs = SlowFileSystem()
    remote = _store(fs)
    manifest = _with_direct_manifest(fs, remote)
    cache = _chain(tmp_path / "node", remote)
    cache._boot._go = gate = _GateSeen()
    assert cache.get(manifest) == _payload(DIRECT)
    assert gate.waiting.wait(60)  # listed, at the gate
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.chain.bootfetch"):
        cache.close(timeout=60)
    assert not cache._boot._thread.is_alive()  # joined by close()
    assert dict(fs.requests) == {"get": 1, "list": 1}  # no batch read after close
    assert cache._boot._batch == frozenset()
    assert {e.name for e in LocalDir(tmp_path / "node").iter_entries()} == {entry_name(DIRECT)}
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_close_while_a_batch_is_read_lands_that_read_and_reads_no_more(tmp_path, release, caplog):
    fs = _HangingBatch(release)
    fs.mkdir("bucket")
    # K - 1 entries in batches of 2; a deadline past any hold, so only the test's release ends the held reads
    remote = RemoteProgramCache(fs, "bucket/kernels", transfer_concurrency=2, timeout=HELD_S)
    for n, key in enumerate(KEYS):
        remote.write_key(key, _payload(key))
        path = fs._strip_protocol(remote.path_for(entry_name(key)))
        fs.objects[path] = (fs.objects[path][0], 1_000_000.0 + n)
    fs.requests.clear()
    fs.hung = {f"{name[:2]}/{name[2:]}" for name in map(entry_name, KEYS[K - 2:])}  # the newest two: the first batch
    cache = _chain(tmp_path / "node", remote)
    assert cache.get(KEYS[0]) == _payload(KEYS[0])  # the trigger, an entry's lookup: the batch goes at once
    assert fs.all_asked.wait(60)  # the first batch of two is out and held
    closer = threading.Thread(target=cache.close, kwargs={"timeout": 60})
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.chain.bootfetch"):
        closer.start()
        assert cache._boot._stop.wait(60)
        release.set()
        closer.join(60)
    assert not closer.is_alive() and not cache._boot._thread.is_alive()
    assert dict(fs.requests) == {"get": 1 + 2, "list": 1}  # the trigger and the batch under way; none after it
    assert (cache._boot.report[0], cache._boot.report[1].entries) == (K, 2)  # it ended as a fetch does, 2 landed
    landed = {e.name for e in LocalDir(tmp_path / "node").iter_entries()}
    assert landed == {entry_name(KEYS[0]), *map(entry_name, KEYS[K - 2:])}
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


_EXIT_CHILD = r"""
import asyncio, atexit, logging, sys, threading
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
logging.getLogger("tiered_progcache.chain.bootfetch").setLevel(logging.DEBUG)
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache
from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.slowfs import SlowFileSystem

release, held = threading.Event(), threading.Event()
keys = [b"exit-%d" % n for n in range(4)]
trigger = entry_name(keys[0])

class Held(SlowFileSystem):
    async def _cat_file(self, path, start=None, end=None, **kwargs):
        if not path.endswith(trigger[2:]):  # the batch's reads wait until the interpreter exits
            held.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
        return await super()._cat_file(path, start, end, **kwargs)

fs = Held()
fs.mkdir("bucket")
remote = RemoteProgramCache(fs, "bucket/kernels", timeout=120)  # held reads end at the release, not a deadline
for key in keys:
    remote.write_key(key, b"cubin:" + key)
cache = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(sys.argv[1]), remote])
assert cache.get(keys[0]) == b"cubin:" + keys[0]
assert held.wait(60)
fetcher = cache._boot._thread

def at_exit():  # after threading's shutdown: the batch's reads answer, and its writers cannot start
    release.set()
    fetcher.join(60)
    print("fetch ended", not fetcher.is_alive(), flush=True)

atexit.register(at_exit)
"""


def test_a_process_that_exits_without_closing_while_its_batch_is_read_says_so_at_debug_only(tmp_path):
    """The interpreter exits with the fetch's reads out: its writers cannot start then, and that is a DEBUG line."""
    import subprocess
    import sys

    from support import child_pythonpath

    done = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(tmp_path / "node")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": child_pythonpath()}, timeout=120)
    stopped = ("DEBUG boot fetch from slow://bucket/kernels stopped: RuntimeError: cannot schedule new futures after "
               "interpreter shutdown\n")
    assert (done.returncode, done.stdout, done.stderr) == (0, "fetch ended True\n", stopped)


def test_close_waits_for_a_hanging_batch_at_most_its_timeout(tmp_path, release, caplog):
    fs = _HangingBatch(release)
    remote = _store(fs, timeout=HELD_S)  # held until the test lets go, however slow the machine
    cache = _chain(tmp_path / "node", remote)
    assert cache.get(KEYS[0]) == _payload(KEYS[0])
    assert fs.all_asked.wait(60)  # the batch's reads are out and held
    closer = threading.Thread(target=cache.close, kwargs={"timeout": 0.2})
    closer.start()
    closer.join(60)
    assert not closer.is_alive()  # back after its 0.2 s, the fetch still held
    assert cache._boot._thread.is_alive() and cache._boot._stop.is_set()
