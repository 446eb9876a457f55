"""The background write queue's order: first in, first out, except what a lease holder's waiters need, which goes first."""

from __future__ import annotations

import threading

from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.writeback import WriteBackQueue, submission_mark

JOIN_S = 30


class GatedStore:
    """A store function that records the order of writes and holds each key until its gate opens."""

    def __init__(self) -> None:
        self.order: list[bytes] = []
        self.started: dict[bytes, threading.Event] = {}
        self.gates: dict[bytes, threading.Event] = {}
        self._lock = threading.Lock()

    def gate(self, key: bytes) -> threading.Event:
        with self._lock:
            return self.gates.setdefault(key, threading.Event())

    def began(self, key: bytes) -> threading.Event:
        with self._lock:
            return self.started.setdefault(key, threading.Event())

    def __call__(self, key: bytes, data: bytes) -> None:
        self.began(key).set()
        assert self.gate(key).wait(JOIN_S)
        self.order.append(key)


def test_writes_go_in_order_and_expedited_ones_go_next_in_their_own_order():
    store = GatedStore()
    queue = WriteBackQueue(store, name="test")
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)  # k0 under way: the rest queue behind it
    queue.submit(b"k1", b"v")
    queue.submit(b"k2", b"v")
    mark = submission_mark()
    queue.submit(b"k3", b"v")
    queue.submit(b"k4", b"v")
    assert queue.expedite(mark) == 2
    for key in (b"k0", b"k1", b"k2", b"k3", b"k4"):
        store.gate(key).set()
    assert queue.flush(JOIN_S)
    assert store.order == [b"k0", b"k3", b"k4", b"k1", b"k2"]
    queue.close()


def test_wait_for_one_key_is_not_held_up_by_writes_queued_after_it():
    store = GatedStore()
    queue = WriteBackQueue(store, name="test")
    assert queue.wait_for(b"never submitted", timeout=0)
    queue.submit(b"mine", b"v")
    queue.submit(b"later", b"v")
    assert store.began(b"mine").wait(JOIN_S)
    assert not queue.wait_for(b"mine", timeout=0)  # under way
    assert not queue.wait_for(b"later", timeout=0)  # queued
    store.gate(b"mine").set()
    assert queue.wait_for(b"mine", timeout=JOIN_S)
    assert queue.pending == 1 and not queue.flush(timeout=0)  # "later" is still held
    store.gate(b"later").set()
    assert queue.flush(JOIN_S) and queue.wait_for(b"later", timeout=0)
    queue.close()


def test_a_cancelled_write_is_no_longer_waited_for():
    store = GatedStore()
    queue = WriteBackQueue(store, name="test")
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    queue.submit(b"k1", b"v")
    assert queue.cancel(b"k1") and queue.wait_for(b"k1", timeout=0)
    store.gate(b"k0").set()
    assert queue.flush(JOIN_S) and store.order == [b"k0"]
    queue.close()


class GatedTier(InMemoryProgramCache):
    """A background tier that records the order of its writes and holds those of ``held`` keys until ``gate``."""

    def __init__(self, held: set[bytes]) -> None:
        super().__init__()
        self.held = held
        self.gate = threading.Event()
        self.started = threading.Event()
        self.order: list[bytes] = []

    def __setitem__(self, key, value):
        if bytes(key) in self.held:
            self.started.set()
            assert self.gate.wait(JOIN_S)
        self.order.append(bytes(key))
        super().__setitem__(key, value)


def _chain(tier: GatedTier) -> TieredProgramCache:
    return TieredProgramCache(tiers=[InMemoryProgramCache(), (tier, TierPolicy("bg", write="background"))])


def test_the_chain_waits_for_one_upload_without_waiting_for_later_ones():
    slow = GatedTier({b"later"})
    cache = _chain(slow)
    cache[b"mine"] = b"v"
    cache[b"later"] = b"v"
    try:
        assert cache.wait_uploaded(b"mine", timeout=JOIN_S)
        assert slow.started.wait(JOIN_S)
        assert not cache.wait_uploaded(b"later", timeout=0) and not cache.flush(timeout=0)
    finally:
        slow.gate.set()
    assert cache.flush(JOIN_S)
    cache.close()


def test_the_chain_expedites_the_uploads_submitted_after_a_mark():
    slow = GatedTier({b"k0"})
    cache = _chain(slow)
    cache[b"k0"] = b"v"
    assert slow.started.wait(JOIN_S)
    cache[b"k1"] = b"v"
    mark = submission_mark()
    cache[b"k2"] = b"v"
    cache.expedite_uploads(mark)
    slow.gate.set()
    assert cache.flush(JOIN_S)
    assert slow.order == [b"k0", b"k2", b"k1"]
    cache.close()
