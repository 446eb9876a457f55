"""WrapperEntryStore: the contracts hold through it, and its faults, holds, delays and counts do what they say."""

from __future__ import annotations

import inspect
import threading
import uuid

import pytest
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import TieredProgramCache
from tiered_progcache.errors import EntryRejected
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import BatchRead, entry_name
from tiered_progcache.testing import (
    EntryStoreTests,
    Gate,
    LeaseStoreTests,
    ProgramCacheContract,
    WrapperEntryStore,
    keyed_chain,
)
from tiered_progcache.testing.wrapper import GATE_TIMEOUT_S, OPERATIONS, Call

from support import FakeClock, FileBackDoor

NAME = entry_name(b"k")


@pytest.fixture
def remote_url(tmp_path):
    return (tmp_path / "remote").as_uri()


@pytest.fixture
def remote(remote_url):
    with RemoteProgramCache.from_url(remote_url, strict=True) as r:
        yield r


# -- the contracts, through the wrapper ------------------------------------------------------------


class TestWrappedLocalDir(EntryStoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return WrapperEntryStore(LocalDir(tmp_path / "cache"))

    @pytest.fixture
    def back_door(self, tmp_path):
        return FileBackDoor(tmp_path / "cache")


class TestWrappedRemote(EntryStoreTests, LeaseStoreTests):
    @pytest.fixture
    def store(self, remote):
        return WrapperEntryStore(remote)

    @pytest.fixture
    def read_only_store(self, remote_url, remote):
        with RemoteProgramCache.from_url(remote_url, read_only=True, strict=True) as r:
            yield WrapperEntryStore(r)

    @pytest.fixture
    def back_door(self, tmp_path):
        return FileBackDoor(tmp_path / "remote")


class TestWrappedRemoteByKey(ProgramCacheContract):
    @pytest.fixture
    def cache(self):
        wrapped = WrapperEntryStore(RemoteProgramCache.from_url(f"memory://wrapped-{uuid.uuid4().hex}/k"))
        with keyed_chain(wrapped) as c:
            yield c
            c.clear()


# -- what the wrapper adds ------------------------------------------------------------------------------


def test_it_forwards_what_the_store_declares(remote):
    wrapped = WrapperEntryStore(remote)
    assert (wrapped.location, wrapped.read_only, wrapped.shared, wrapped.atomic_create, wrapped.namespace) == (
        remote.location, False, True, True, "entries")
    assert (wrapped.available, wrapped.max_entry_bytes, wrapped.transfer_batch) == (
        True, remote.max_entry_bytes, remote.transfer_batch)
    assert wrapped.round_trip_s == remote.round_trip_s
    assert WrapperEntryStore(remote, round_trip_s=0.25).round_trip_s == 0.25  # latency the flight policy sees
    assert wrapped.leases() is remote.leases() and wrapped.calls["leases"] == 1


def test_a_fault_raises_for_the_next_n_calls_then_the_store_answers(remote):
    wrapped = WrapperEntryStore(remote)
    wrapped.write_entry(NAME, b"x")
    wrapped.fail("read_entry", ConnectionError("down"), times=2)
    for _ in range(2):
        with pytest.raises(ConnectionError, match="down"):
            wrapped.read_entry(NAME)
    assert wrapped.read_entry(NAME) == b"x"
    assert wrapped.calls["read_entry"] == 3  # a failed call counts
    assert remote.breaker.consecutive_failures == 0  # the fault never reached the store


def test_a_fault_can_name_one_entry_and_many_operations(remote):
    other = entry_name(b"other")
    wrapped = WrapperEntryStore(remote)
    wrapped.fail(["write_entry", "create_entry"], PermissionError, name=NAME)
    with pytest.raises(PermissionError, match="injected fault in write_entry"):
        wrapped.write_entry(NAME, b"x")
    with pytest.raises(PermissionError, match="injected fault in create_entry"):
        wrapped.create_entry(NAME, b"x")
    wrapped.write_entry(other, b"y")  # another entry: untouched
    assert [e.name for e in remote.iter_entries()] == [other]
    wrapped.clear_rules()
    wrapped.write_entry(NAME, b"x")
    assert remote.read_entry(NAME) == b"x"


def test_a_hold_keeps_the_call_until_its_gate_opens(remote):
    wrapped = WrapperEntryStore(remote)
    gate = wrapped.hold("write_entry")
    writer = threading.Thread(target=wrapped.write_entry, args=(NAME, b"x"))
    writer.start()
    try:
        assert gate.wait_arrived(30)
        assert gate.held == 1 and not gate.is_open
        with pytest.raises(KeyError):
            remote.read_entry(NAME)  # held before the store saw it
    finally:
        gate.open()
        writer.join(30)
    assert not writer.is_alive() and remote.read_entry(NAME) == b"x"
    wrapped.write_entry(NAME, b"y")  # an open gate lets later calls through
    assert remote.read_entry(NAME) == b"y"


def test_a_gate_never_opened_fails_the_call_instead_of_hanging(remote):
    wrapped = WrapperEntryStore(remote)
    wrapped.hold("iter_entries", timeout=0.01)
    with pytest.raises(TimeoutError, match="gate never opened"):
        wrapped.iter_entries()


def test_a_held_call_waits_the_documented_60_s_by_default(remote):
    assert GATE_TIMEOUT_S == 60.0  # docs/writing-a-tier.md
    assert inspect.signature(WrapperEntryStore.hold).parameters["timeout"].default == GATE_TIMEOUT_S
    assert inspect.signature(Gate).parameters["timeout"].default == GATE_TIMEOUT_S


def test_a_delay_goes_through_the_injected_sleep(remote):
    clock = FakeClock()
    wrapped = WrapperEntryStore(remote, sleep=clock.advance)
    wrapped.delay("read_many", 2.5, times=1)
    wrapped.delay(["write_entry", "read_many"], 0.5)
    wrapped.write_entry(NAME, b"x")
    assert clock.now == 1000.5
    assert wrapped.read_many([NAME]) == BatchRead(hits={NAME: b"x"})
    assert clock.now == 1003.5
    wrapped.read_many([NAME])
    assert clock.now == 1004.0  # the one-off delay is spent


def test_calls_are_counted_and_logged_with_their_names(remote):
    wrapped = WrapperEntryStore(remote)
    a, b = entry_name(b"a"), entry_name(b"b")
    wrapped.write_key(b"a", b"1")  # the keyed reads and writes go through the entry operations
    wrapped.write_many({b: b"2"})
    assert wrapped.read_key(b"a") == b"1"
    with pytest.raises(KeyError):
        wrapped.read_key(b"missing")
    assert wrapped.count() == 2
    assert wrapped.names("read_entry", "write_entry", "write_many") == [a, b, a, entry_name(b"missing")]
    assert wrapped.log[0] == Call("write_entry", (a,)) and wrapped.calls["iter_entries"] == 1
    wrapped.reset_counts()
    assert not wrapped.calls and wrapped.log == []


def test_a_rejected_entry_stays_rejected_through_the_keyed_read(remote):
    wrapped = WrapperEntryStore(remote)
    wrapped.write_key(b"k", b"x")
    wrapped.fail("read_entry", EntryRejected("digest mismatch"), times=1)
    with pytest.raises(EntryRejected):
        wrapped.read_key(b"k")
    with pytest.raises(KeyError) as miss:
        wrapped.read_key(b"absent")
    assert type(miss.value) is KeyError and miss.value.args == (entry_name(b"absent"),)


def test_in_a_chain_each_injected_failure_is_a_counted_miss(tmp_path, remote):
    wrapped = WrapperEntryStore(remote)
    remote.write_entry(NAME, b"\x7fELF")
    with TieredProgramCache(tiers=[InMemoryProgramCache(), wrapped]) as chain:
        assert chain.shared_store is wrapped
        wrapped.fail("read_entry", TimeoutError, times=1)
        wrapped.fail("read_entry", EntryRejected("bad"), times=1)
        wrapped.fail("read_entry", OSError("reset"), times=1)
        assert [chain.get(b"k") for _ in range(3)] == [None, None, None]
        assert chain.get(b"k") == b"\x7fELF"
        stats = chain.stats()["remote"]
        assert (stats.timeouts, stats.rejected, stats.errors, stats.hits) == (1, 1, 1, 1)


@pytest.mark.parametrize(("args", "error"), [
    (("read", OSError), ValueError),
    (([], OSError), ValueError),
    (("read_entry", "not an exception"), TypeError),
    (("read_entry", int), TypeError),
])
def test_bad_rules_are_refused(remote, args, error):
    with pytest.raises(error):
        WrapperEntryStore(remote).fail(*args)


def test_bad_arguments_are_named(remote):
    wrapped = WrapperEntryStore(remote)
    with pytest.raises(ValueError, match="times"):
        wrapped.fail("read_entry", OSError, times=0)
    with pytest.raises(ValueError, match="seconds"):
        wrapped.delay("read_entry", -1)
    with pytest.raises(TypeError, match="wraps an EntryStore"):
        WrapperEntryStore(InMemoryProgramCache())
    assert set(OPERATIONS) >= {"read_entry", "write_entry", "iter_entries", "leases"}
