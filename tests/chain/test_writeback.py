"""The background write queue's order: first in, first out, except what a lease holder's waiters need, which goes first."""

from __future__ import annotations

import threading

import pytest
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.chain.writeback import WriteBackQueue, submission_mark

from support import in_forked_child

JOIN_S = 30


class GatedStore:
    """A store function that records the order of writes and holds each key until its gate opens."""

    def __init__(self) -> None:
        self.order: list[bytes] = []
        self.started: dict[bytes, threading.Event] = {}
        self.gates: dict[bytes, threading.Event] = {}
        self._open = False
        self._lock = threading.Lock()

    def gate(self, key: bytes) -> threading.Event:
        with self._lock:
            gate = self.gates.setdefault(key, threading.Event())
            if self._open:
                gate.set()
            return gate

    def open_all(self) -> None:
        """Let every write through, those held now and those to come (teardown)."""
        with self._lock:
            self._open = True
            for gate in self.gates.values():
                gate.set()

    def began(self, key: bytes) -> threading.Event:
        with self._lock:
            return self.started.setdefault(key, threading.Event())

    def __call__(self, key: bytes, data: bytes) -> None:
        self.began(key).set()
        assert self.gate(key).wait(JOIN_S)
        self.order.append(key)


@pytest.fixture
def store(cleanup) -> GatedStore:
    """A :class:`GatedStore` whose gates all open at teardown, so no worker stays held in it."""
    gated = GatedStore()
    cleanup.gate(gated.open_all)
    return gated


@pytest.fixture
def queue_of(cleanup):
    """``WriteBackQueue(...)``, closed at teardown (after every gate opened) and its worker joined."""

    def make(*args, **kwargs) -> WriteBackQueue:
        return cleanup.close(WriteBackQueue(*args, **kwargs), JOIN_S)

    return make


@pytest.fixture
def queue(store, queue_of) -> WriteBackQueue:
    """A queue named "test" that writes to ``store``."""
    return queue_of(store, name="test")


def test_writes_go_in_order_and_expedited_ones_go_next_in_their_own_order(store, queue):
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


def test_wait_for_one_key_is_not_held_up_by_writes_queued_after_it(store, queue):
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


def test_a_cancelled_write_is_no_longer_waited_for(store, queue):
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    queue.submit(b"k1", b"v")
    assert queue.cancel(b"k1") and queue.wait_for(b"k1", timeout=0)
    store.gate(b"k0").set()
    assert queue.flush(JOIN_S) and store.order == [b"k0"]


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


@pytest.fixture
def chain_of(cleanup):
    """A memory tier over ``tier`` as a background tier; the tier's gate opens and the chain closes at teardown."""

    def make(tier: GatedTier) -> TieredProgramCache:
        cleanup.gate(tier.gate)
        return cleanup.close(
            TieredProgramCache(tiers=[InMemoryProgramCache(), (tier, TierPolicy("bg", write="background"))]), JOIN_S
        )

    return make


def test_the_chain_waits_for_one_upload_without_waiting_for_later_ones(chain_of):
    slow = GatedTier({b"later"})
    cache = chain_of(slow)
    cache[b"mine"] = b"v"
    cache[b"later"] = b"v"
    assert cache.wait_uploaded(b"mine", timeout=JOIN_S)
    assert slow.started.wait(JOIN_S)
    assert not cache.wait_uploaded(b"later", timeout=0) and not cache.flush(timeout=0)
    slow.gate.set()
    assert cache.flush(JOIN_S)


def test_the_chain_expedites_the_uploads_submitted_after_a_mark(chain_of):
    slow = GatedTier({b"k0"})
    cache = chain_of(slow)
    cache[b"k0"] = b"v"
    assert slow.started.wait(JOIN_S)
    cache[b"k1"] = b"v"
    mark = submission_mark()
    cache[b"k2"] = b"v"
    cache.expedite_uploads(mark)
    slow.gate.set()
    assert cache.flush(JOIN_S)
    assert slow.order == [b"k0", b"k2", b"k1"]


# -- the queue's bounds, refusals and accounting, exactly --------------------------------------------

import logging  # noqa: E402
import time  # noqa: E402

from tiered_progcache.chain import exitbudget, writeback  # noqa: E402
from tiered_progcache.chain.writeback import Refused  # noqa: E402


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8"])
def test_a_bad_max_pending_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="max_pending must be a positive int"):
        WriteBackQueue(GatedStore(), max_pending=bad)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_a_bad_max_pending_bytes_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="max_pending_bytes must be a positive int or None"):
        WriteBackQueue(GatedStore(), max_pending_bytes=bad)


def test_the_worker_is_one_named_daemon_thread_started_by_the_first_write(store, queue_of):
    before = {t.name for t in threading.enumerate()}
    queue = queue_of(store, name="remote7")
    assert {t.name for t in threading.enumerate()} == before  # nothing runs before a write
    assert queue.submit(b"k0", b"v") is None
    assert store.began(b"k0").wait(JOIN_S)
    (worker,) = [t for t in threading.enumerate() if t.name == "tiered-progcache-writeback-remote7"]
    assert worker.daemon
    store.gate(b"k0").set()
    assert queue.submit(b"k1", b"v") is None
    store.gate(b"k1").set()
    assert queue.flush(JOIN_S)
    assert [t.name for t in threading.enumerate()].count("tiered-progcache-writeback-remote7") == 1
    assert queue.close(JOIN_S) is True
    worker.join(JOIN_S)
    assert not worker.is_alive()  # closed and drained: the worker ends


def test_a_full_queue_refuses_a_new_key_but_still_takes_a_newer_value_of_a_queued_one(store, queue_of):
    queue = queue_of(store, max_pending=2, name="test")
    assert queue.submit(b"k0", b"v0") is None
    assert store.began(b"k0").wait(JOIN_S)  # under way: not counted against the queue's length
    assert queue.submit(b"k1", b"v1") is None
    assert queue.submit(b"k2", b"v2") is None
    assert queue.pending == 3  # two queued, one under way
    assert queue.submit(b"k3", b"v3") is Refused.FULL
    assert queue.submit(b"k1", b"v1 again") is None  # a replacement, not a new entry
    assert queue.pending == 3 and queue.pending_bytes == 2 + 8 + 2
    for key in (b"k0", b"k1", b"k2"):
        store.gate(key).set()
    assert queue.flush(JOIN_S)
    assert store.order == [b"k0", b"k1", b"k2"] and queue.pending == 0 and queue.pending_bytes == 0


def test_the_byte_bound_counts_queued_and_under_way_bytes_and_a_write_of_exactly_the_bound_fits(store, queue_of):
    queue = queue_of(store, max_pending_bytes=10, name="test")
    assert queue.submit(b"k0", b"4444") is None
    assert store.began(b"k0").wait(JOIN_S)
    assert queue.submit(b"k1", b"666666") is None  # 4 + 6 = 10: exactly the bound
    assert queue.pending_bytes == 10
    assert queue.submit(b"k2", b"1") is Refused.TOO_MANY_BYTES
    assert queue.submit(b"k1", b"55555") is None  # replaced: 4 + 5
    assert queue.pending_bytes == 9
    assert queue.submit(b"k1", b"7777777") is Refused.TOO_MANY_BYTES  # 9 - 5 + 7 = 11
    assert queue.pending_bytes == 9
    assert queue.submit(b"k1", b"666666") is None  # 9 - 5 + 6 = 10 again
    assert queue.pending_bytes == 10
    store.gate(b"k0").set()
    assert queue.wait_for(b"k0", JOIN_S)
    assert queue.pending_bytes == 6  # the written bytes are given back
    store.gate(b"k1").set()
    assert queue.flush(JOIN_S) and queue.pending_bytes == 0


def test_cancel_drops_only_a_queued_write_and_gives_its_bytes_back(store, queue):
    queue.submit(b"k0", b"under way")
    assert store.began(b"k0").wait(JOIN_S)
    queue.submit(b"k1", b"queued")
    assert queue.pending == 2 and queue.pending_bytes == 9 + 6
    assert queue.cancel(b"k0") is False  # under way: not the queue's to drop
    assert queue.cancel(b"never") is False
    assert queue.cancel(b"k1") is True
    assert queue.cancel(b"k1") is False  # gone already
    assert queue.pending == 1 and queue.pending_bytes == 9
    store.gate(b"k0").set()
    assert queue.flush(JOIN_S) and store.order == [b"k0"]


def test_a_cancel_wakes_a_flush_that_waited_only_for_the_cancelled_write(store, queue, cleanup):
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    queue.submit(b"k1", b"v")
    store.gate(b"k0").set()
    assert queue.wait_for(b"k0", JOIN_S)
    # k1 is queued or under way now; hold it, then cancel whatever of it is still queued.
    flushed = threading.Event()
    cleanup.thread(lambda: queue.flush(JOIN_S) and flushed.set())
    queue.cancel(b"k1")
    store.gate(b"k1").set()
    assert flushed.wait(JOIN_S)


def test_close_drops_what_is_left_when_its_time_runs_out_and_refuses_later_writes(caplog, store, queue_of):
    queue = queue_of(store, name="slowtier")
    queue.submit(b"k0", b"held")
    assert store.began(b"k0").wait(JOIN_S)
    queue.submit(b"k1", b"queued1")
    queue.submit(b"k2", b"queued22")
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.chain.writeback"):
        assert queue.close(timeout=0) is False
    assert [r.getMessage() for r in caplog.records] == ["write-back slowtier closed with 2 writes not done"]
    assert queue.pending == 1 and queue.pending_bytes == 4  # the held one is still under way; the queued are gone
    assert queue.submit(b"k3", b"v") is Refused.CLOSED
    store.gate(b"k0").set()
    assert queue.flush(JOIN_S) and store.order == [b"k0"] and queue.pending_bytes == 0


def test_close_with_nothing_left_says_nothing(caplog, store, queue_of):
    queue = queue_of(store, name="idle")
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.chain.writeback"):
        assert queue.close(timeout=0) is True
    assert caplog.records == []


def test_a_store_that_raises_is_logged_and_the_worker_carries_on(caplog, queue_of):
    written = []

    def store(key: bytes, data: bytes) -> None:
        if key == b"bad":
            raise OSError("disk on fire")
        written.append(key)

    queue = queue_of(store, name="flaky")
    with caplog.at_level(logging.ERROR, logger="tiered_progcache.chain.writeback"):
        queue.submit(b"bad", b"v")
        queue.submit(b"good", b"v")
        assert queue.flush(JOIN_S)
    assert written == [b"good"] and queue.pending == 0 and queue.pending_bytes == 0
    (record,) = caplog.records
    assert record.getMessage() == "write-back flaky: store raised" and record.exc_info is not None


def test_wait_for_and_flush_without_a_timeout_wait_until_done(store, queue, cleanup):
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    done = []
    waiter = cleanup.thread(lambda: done.append((queue.flush(), queue.wait_for(b"k0"))))
    store.gate(b"k0").set()
    waiter.join(JOIN_S)
    assert done == [(True, True)]


def test_submission_marks_increase_across_queues(store, queue_of):
    first = submission_mark()
    queue = queue_of(store, name="test")
    queue.submit(b"k", b"v")
    assert submission_mark() > first + 1  # the write took a sequence number between the two marks


def test_a_queue_after_fork_starts_empty_with_no_worker_and_writes_its_own(monkeypatch, cleanup, queue_of):
    """What the child of a fork sees (the fork itself runs in test_chain_faults): called here directly."""
    _private_registry(monkeypatch)
    hold, started = threading.Event(), threading.Event()
    cleanup.gate(hold)
    written = []

    def store(key: bytes, data: bytes) -> None:
        if key.startswith(b"parent"):
            started.set()
            hold.wait()  # the parent's worker, which a real child would not have
        written.append(key)

    queue = queue_of(store, name="test")
    queue.submit(b"parent0", b"v")
    assert started.wait(JOIN_S)
    queue.submit(b"parent1", b"v")  # queued behind parent0, which is under way
    writeback._after_fork_in_child()
    assert queue.pending == 0 and queue.pending_bytes == 0
    assert queue.wait_for(b"parent0", 0) and queue.wait_for(b"parent1", 0) and queue.flush(0)
    assert queue.submit(b"child", b"v") is None  # a fresh worker for the child's own write
    assert queue.flush(JOIN_S) and written == [b"child"]


def test_a_closed_queue_stays_closed_after_fork(monkeypatch, store, queue_of):
    _private_registry(monkeypatch)
    queue = queue_of(store, name="test")
    queue.close()
    queue._forget_after_fork()
    assert queue.submit(b"k", b"v") is Refused.CLOSED


def _private_registry(monkeypatch) -> None:
    """Queues built after this register in a set of the test's own, so the exit and fork hooks see only them
    (and the real exit flush never sees a queue a test left in a made-up state)."""
    import weakref

    monkeypatch.setattr(writeback, "_live_queues", weakref.WeakSet())


def test_the_exit_flush_starts_the_exit_budget_and_warns_of_what_it_could_not_flush(monkeypatch, caplog, store, queue_of):
    times = iter([0.0] + [10.0] * 100)  # the clock starts at 0, and the budget (2 s) is spent at once
    budget = exitbudget.ExitBudget(lambda: next(times))
    budget.allow(2.0)
    monkeypatch.setattr(exitbudget, "PROCESS", budget)
    _private_registry(monkeypatch)
    stuck = queue_of(store, name="stuck")
    stuck.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    stuck.submit(b"k1", b"v")
    idle = queue_of(GatedStore(), name="idle")
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.chain.writeback"):
        writeback._flush_at_exit()
    assert budget.began and budget.begin() == 2.0 - exitbudget.TEARDOWN_RESERVE_S
    assert [r.getMessage() for r in caplog.records] == ["interpreter exit: 2 background writes not flushed in time"]
    store.gate(b"k0").set()
    store.gate(b"k1").set()
    assert stuck.flush(JOIN_S)


def test_the_exit_flush_flushes_what_it_can_within_the_budget(monkeypatch, caplog, queue_of):
    budget = exitbudget.ExitBudget()
    monkeypatch.setattr(exitbudget, "PROCESS", budget)
    _private_registry(monkeypatch)
    written = []
    queue = queue_of(lambda key, data: written.append(key), name="fast")
    queue.submit(b"k", b"v")
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.chain.writeback"):
        writeback._flush_at_exit()
    assert budget.began and written == [b"k"] and caplog.records == []


def test_the_exit_flush_is_registered_on_threadings_early_exit_hook_else_on_atexit(monkeypatch):
    early, late = [], []
    monkeypatch.setattr(threading, "_register_atexit", early.append, raising=False)
    monkeypatch.setattr(writeback.atexit, "register", late.append)
    writeback._register_exit_flush()
    assert (early, late) == ([writeback._flush_at_exit], [])
    monkeypatch.delattr(threading, "_register_atexit")
    writeback._register_exit_flush()
    assert (early, late) == ([writeback._flush_at_exit], [writeback._flush_at_exit])


def test_wait_for_with_less_than_a_second_left_still_waits_for_the_write(store, queue):
    """A short timeout is waited out, not taken as spent: the write ends while wait_for waits."""
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    store.gate(b"k0").set()  # the worker finishes as soon as this thread waits (it only needs the GIL)
    assert queue.wait_for(b"k0", timeout=0.9) is True
    queue.submit(b"k1", b"v")
    assert store.began(b"k1").wait(JOIN_S)
    store.gate(b"k1").set()
    assert queue.flush(timeout=0.9) is True


def test_a_flush_with_time_left_waits_at_most_that_long_for_a_stuck_write(store, queue):
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    assert queue.flush(timeout=0.05) is False  # it waits, then gives up: never until the write ends
    assert queue.wait_for(b"k0", timeout=0.05) is False
    store.gate(b"k0").set()
    assert queue.flush(JOIN_S)


def test_the_smallest_bounds_are_one_write_and_one_byte(store, queue_of):
    queue = queue_of(store, max_pending=1, max_pending_bytes=1)
    assert queue.submit(b"k0", b"1") is None
    assert store.began(b"k0").wait(JOIN_S)
    assert queue.submit(b"k1", b"") is None  # one queued: the length bound; 1 byte: the byte bound
    assert queue.submit(b"k2", b"") is Refused.FULL
    store.gate(b"k0").set()
    store.gate(b"k1").set()
    assert queue.flush(JOIN_S)
    (worker,) = [t for t in threading.enumerate() if t.name == "tiered-progcache-writeback-"]  # no name given
    queue.close(JOIN_S)
    worker.join(JOIN_S)


def test_by_default_1024_writes_queue_behind_the_one_under_way(store, queue):
    queue.submit(b"first", b"v")
    assert store.began(b"first").wait(JOIN_S)
    assert all(queue.submit(b"k%d" % n, b"") is None for n in range(1024))
    assert queue.submit(b"one too many", b"") is Refused.FULL
    assert queue.pending == 1025
    queue.close(timeout=0)
    store.gate(b"first").set()


def test_the_fork_hook_empties_every_live_queue(monkeypatch, cleanup, queue_of):
    """In a real forked child every queue starts empty: the parent's writes, under way or queued, are the parent's."""
    _private_registry(monkeypatch)
    stores = (GatedStore(), GatedStore())
    for gated in stores:
        cleanup.gate(gated.open_all)
    first, second = queue_of(stores[0], name="a"), queue_of(stores[1], name="b")
    for queue, store in zip((first, second), stores):
        queue.submit(b"under way", b"v")
        assert store.began(b"under way").wait(JOIN_S)  # its worker is in the store, not in the queue's lock
        queue.submit(b"queued", b"vv")
    seen = in_forked_child(lambda: [first.pending, second.pending, first.pending_bytes, second.pending_bytes])
    assert seen == [0, 0, 0, 0]
    assert (first.pending, second.pending, first.pending_bytes, second.pending_bytes) == (2, 2, 3, 3)  # the parent's


def test_no_bookkeeping_is_left_for_writes_done_or_cancelled(store, queue):
    """A long-lived process writes millions of keys: nothing may stay behind per key."""
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    queue.submit(b"k1", b"v")
    assert queue.cancel(b"k1")
    store.gate(b"k0").set()
    assert queue.flush(JOIN_S)
    assert (queue._submitted_at, queue._in_flight_keys, dict(queue._pending)) == ({}, set(), {})


def test_discard_drops_the_queued_writes_and_waits_for_the_one_under_way(store, queue):
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)  # under way: it cannot be taken back
    queue.submit(b"k1", b"vv")
    queue.submit(b"k2", b"vvv")
    assert not queue.discard(timeout=0)  # k0 still under way
    assert queue.pending == 1 and queue.pending_bytes == 1  # only k0 is left
    store.gate(b"k0").set()
    assert queue.discard(timeout=JOIN_S) and queue.pending == 0 and queue.pending_bytes == 0
    store.gate(b"k1").set()
    store.gate(b"k2").set()
    assert queue.flush(JOIN_S) and store.order == [b"k0"]  # the dropped writes never ran


@pytest.fixture
def file_chain(tmp_path, cleanup) -> TieredProgramCache:
    """A memory tier over a cuda-core file tier written in the background, closed at teardown."""
    from cuda.core.utils import FileStreamProgramCache

    tiers = [InMemoryProgramCache(), (FileStreamProgramCache(tmp_path / "bg"), TierPolicy("bg", write="background"))]
    return cleanup.close(TieredProgramCache(tiers=tiers), JOIN_S)


def test_clear_of_a_background_tier_leaves_it_empty_though_writes_were_queued(file_chain, store, cleanup):
    chain = file_chain
    bg = chain.tier("bg")
    real = bg.writeback._store
    bg.writeback._store = lambda key, data: (store(key, data), real(key, data))
    for n in range(3):
        chain[b"k%d" % n] = b"v%d" % n
    assert store.began(b"k0").wait(JOIN_S)
    clearing = cleanup.thread(chain.clear)
    queue = bg.writeback
    with queue._cond:  # clear() has dropped k1 and k2 (it notifies), and waits for k0, under way
        assert queue._cond.wait_for(lambda: not queue._pending, timeout=JOIN_S)
    store.gate(b"k0").set()  # k0 lands; clear() then empties the tier
    clearing.join(JOIN_S)
    assert not clearing.is_alive()
    for n in range(3):
        store.gate(b"k%d" % n).set()
    assert chain.flush(JOIN_S) and len(chain) == 0 and store.order == [b"k0"]


def test_clear_waits_for_a_write_under_way_at_most_clear_wait_s(file_chain, store, monkeypatch, caplog):
    monkeypatch.setattr("tiered_progcache.chain.tier.CLEAR_WAIT_S", 0.01)
    chain = file_chain
    bg = chain.tier("bg")
    bg.writeback._store = store
    chain[b"stuck"] = b"v"
    assert store.began(b"stuck").wait(JOIN_S)
    chain.clear()  # returns though the write is still held
    assert [r.getMessage() for r in caplog.records if "clear()" in r.getMessage()] == [
        "tier bg: a background write still under way after 0 s may land after clear()"]
    store.gate(b"stuck").set()
    assert chain.flush(JOIN_S)


def test_discard_without_a_timeout_waits_for_the_write_under_way_as_long_as_it_takes(store, queue, cleanup):
    assert queue.discard()  # nothing queued, nothing under way: at once
    queue.submit(b"k0", b"v")
    assert store.began(b"k0").wait(JOIN_S)
    queue.submit(b"k1", b"v")

    def release_once_discard_waits() -> None:
        with queue._cond:  # discard() has dropped k1 and waits (its wait lets this in), k0 still under way
            assert queue._cond.wait_for(lambda: not queue._pending, timeout=JOIN_S)
            store.gate(b"k0").set()

    releaser = cleanup.thread(release_once_discard_waits)
    assert queue.discard()  # no timeout: returns once k0 is done
    releaser.join(JOIN_S)
    assert queue.pending == 0 and store.order == [b"k0"]
