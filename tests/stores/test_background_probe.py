"""A shared tier's first probe runs on a thread of its own: the constructor returns at once, every request waits for it.

So a fresh process's first compile runs beside the client's construction and the first round
trip. ``strict=True`` keeps the probe in the constructor, where a bad configuration raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tiered_progcache import TieredProgramCache, TierUnavailable
from tiered_progcache.chain.downmemo import DownMemo
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.runner import PROBE_DEADLINES, RequestRunner
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.slowfs import SlowFileSystem


class HeldProbeFileSystem(SlowFileSystem):
    """A store whose bucket probe (``_info`` of the bucket) waits for ``probe_gate``; it records each request's
    operation and whether the probe had answered when the request arrived."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.probe_gate = threading.Event()
        self.probe_answered = False
        self.probe_fails = False  # once released, the probe raises (the store is down) instead of answering
        self.listing_fails = False
        self.listing_made = threading.Event()
        self.listing_gate = threading.Event()  # a listing answers once it is set (set here: at once)
        self.listing_gate.set()
        self.seen: list[tuple[str, bool]] = []
        self._arrived = threading.Condition()

    def _note(self, request: tuple[str, bool]) -> None:
        with self._arrived:
            self.seen.append(request)
            self._arrived.notify_all()

    def wait_seen(self, count: int) -> bool:
        """Wait until ``count`` requests have arrived (False after 60 s)."""
        with self._arrived:
            return self._arrived.wait_for(lambda: len(self.seen) >= count, 60)

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        if path.strip("/") in self.buckets:
            self._note(("probe", self.probe_answered))
            while not self.probe_gate.is_set():  # on the loop: yield to it while held
                await _sleep_briefly()
            if self.probe_fails:
                raise ConnectionRefusedError("the store is down")
            self.probe_answered = True
        return await super()._info(path, **kwargs)

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        self._note(("list", self.probe_answered))
        self.listing_made.set()
        while not self.listing_gate.is_set():
            await _sleep_briefly()
        if self.listing_fails:
            raise ConnectionRefusedError("the store is down")
        return await super()._find(path, maxdepth=maxdepth, withdirs=withdirs, **kwargs)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self._note(("read", self.probe_answered))
        return await super()._cat_file(path, start, end, **kwargs)


async def _sleep_briefly() -> None:
    import asyncio

    await asyncio.sleep(0.001)


#: What a held probe has sent: its two bucket requests at once (an async store's pool keeps both connections).
PROBE_HELD = [("probe", False), ("probe", False)]


def _held_store(**options: Any) -> tuple[RemoteProgramCache, HeldProbeFileSystem]:
    fs = HeldProbeFileSystem()
    fs.mkdir("bucket")
    return RemoteProgramCache(fs, "bucket/kernels", **options), fs


def _chain_over(store: RemoteProgramCache, tmp_path: Any) -> TieredProgramCache:
    """Memory, an empty local directory, then ``store``: its first shared lookup starts the boot fetch."""
    from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

    return TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"), store])


def _answer_the_probe_and_hold_the_sample(store: RemoteProgramCache, fs: HeldProbeFileSystem) -> Any:
    """The probe answers, but ``R``'s first sample is claimed here and never ends (until ``probe.sampled()``)."""
    probe = store.runner._probe
    assert probe is not None and probe.claim_sample()  # a request that will be the sample, and never ends
    fs.probe_gate.set()
    assert probe.done.wait(60) and not store.wait_ready(0)  # the probe answered; the sample is still out
    return probe


class _SeenWaiting(threading.Event):
    """An event that records the threads that wait on it: put in place of a probe's ``done`` before the probe
    ends, it shows which requests wait for the probe, without polling."""

    def __init__(self) -> None:
        super().__init__()
        self._seen = threading.Condition()
        self.waiters: set[threading.Thread] = set()

    def wait(self, timeout: float | None = None) -> bool:
        with self._seen:
            self.waiters.add(threading.current_thread())
            self._seen.notify_all()
        return super().wait(timeout)

    def waited_on_by(self, *threads: threading.Thread) -> bool:
        """Wait until each of ``threads`` waits on this event (False after 60 s)."""
        with self._seen:
            return self._seen.wait_for(lambda: self.waiters.issuperset(threads), 60)


def _watch_waits_for(runner: RequestRunner) -> _SeenWaiting:
    """Put a :class:`_SeenWaiting` in place of ``runner``'s probe's ``done`` (the probe must not have ended)."""
    probe = runner._probe
    assert probe is not None and not probe.done.is_set()
    probe.done = done = _SeenWaiting()  # the probe sets this one when it ends
    return done


def _record_waits(store: Any) -> tuple[list[float | None], Any]:
    """Make ``store.wait_ready`` record each timeout it is asked for; the list, and the real ``wait_ready``."""
    asked: list[float | None] = []
    real_wait = store.wait_ready

    def recording_wait(timeout: float | None = None) -> bool:
        asked.append(timeout)
        return real_wait(timeout)

    store.wait_ready = recording_wait
    return asked, real_wait


def test_the_constructor_returns_while_the_probe_is_held_and_a_read_waits_for_it():
    store, fs = _held_store(timeout=60)
    try:
        assert not store.wait_ready(0)  # built, the probe still in flight
        read: list[Any] = []
        done = _watch_waits_for(store.runner)
        reader = threading.Thread(target=lambda: read.append(store.verify_entry(entry_name(b"k"))))
        reader.start()
        assert done.waited_on_by(reader) and fs.wait_seen(len(PROBE_HELD))  # both at their gates
        assert fs.seen == PROBE_HELD  # the read has not reached the store
    finally:
        fs.probe_gate.set()
    reader.join(60)
    assert read == ["missing"]
    assert store.wait_ready(60) and store.available
    # The read that waited is R's first sample, on the connection the probe opened: no request beside it.
    assert fs.seen == [*PROBE_HELD, ("read", True)] and store.runner.latency.recorded == 1


def test_a_request_waits_for_the_probes_outcome_and_does_not_ask_a_store_found_down():
    """The probe runs into its deadline (the store holds it): the read waited for that, then the breaker refused it."""
    store, fs = _held_store(timeout=0.2)
    try:
        with pytest.raises(TierUnavailable):
            store.verify_entry(entry_name(b"k"))
        assert fs.seen == PROBE_HELD and not store.available
    finally:
        fs.probe_gate.set()


def test_a_request_waits_for_a_probe_at_most_as_long_as_a_probe_can_take():
    """Three deadlines (the filesystem's construction, two requests); a probe held past them is not waited for."""
    held = threading.Event()
    runner = RequestRunner(MemoryFileSystem(), timeout=0.2, breaker=CircuitBreaker(), name="test remote")
    runner.start_probe(held.wait)  # a probe that outlives every deadline (only a bug could)
    try:
        started = time.monotonic()
        assert runner.call("read", lambda: "answered", None) == "answered"
        assert PROBE_DEADLINES == 3
        assert time.monotonic() - started >= 0.2 * PROBE_DEADLINES and not runner.wait_probed(0)
    finally:
        held.set()


def test_a_request_that_outlived_its_wait_for_the_probe_gives_the_first_sample_back_to_the_probe():
    """The read claimed R's first sample but ended before the probe did: the probe's thread takes it after all."""
    held = threading.Event()
    sampled: list[str] = []
    runner = RequestRunner(MemoryFileSystem(), timeout=0.05, breaker=CircuitBreaker(), name="test remote")
    runner.start_probe(held.wait, lambda: sampled.append("after the probe"))
    try:
        assert runner.call("read", lambda: "answered", None) == "answered"  # waited its 3 deadlines, then ran
        assert not runner.wait_probed(0) and sampled == []
    finally:
        held.set()
    assert runner.wait_probed(60) and sampled == ["after the probe"]


def test_the_sample_is_in_only_when_the_request_that_claimed_it_has_ended():
    """Two requests wait for the probe; the second ends first: R's first sample is still to come (``wait_ready``
    waits for the first), and the probe's thread makes no request of its own."""
    held, in_flight = threading.Event(), threading.Event()
    extra: list[str] = []
    runner = RequestRunner(MemoryFileSystem(), timeout=60, breaker=CircuitBreaker(), name="test remote")
    runner.start_probe(held.wait, lambda: extra.append("the probe's own"))
    first = threading.Thread(target=runner.call, args=("read", in_flight.wait, None))
    second = threading.Thread(target=runner.call, args=("read", lambda: "answered", None))
    done = _watch_waits_for(runner)
    try:
        for thread in (first, second):  # one after the other: the first to wait claims the sample
            thread.start()
            assert done.waited_on_by(thread), "the request never waited for the probe"
        held.set()
        second.join(60)
        assert not second.is_alive() and runner.latency.recorded == 1
        assert not runner.wait_probed(0)  # the claimed sample is still in flight
    finally:
        held.set()
        in_flight.set()
    first.join(60)
    assert runner.wait_probed(60) and runner.latency.recorded == 2 and extra == []


def test_a_probe_that_raises_and_a_step_after_it_that_raises_are_logged_and_requests_go_on(caplog):
    """Only a bug makes either raise (the probe records what it found on the breaker): each is one ERROR line with
    its traceback, and the requests waiting for the probe go on."""
    runner = RequestRunner(MemoryFileSystem(), timeout=60, breaker=CircuitBreaker(), name="test remote")
    gate = threading.Event()
    with caplog.at_level(logging.ERROR, logger="tiered_progcache.stores.runner"):
        runner.start_probe(lambda: gate.wait(60) and 1 / 0)
        runner.when_probed(lambda: [][0])  # kept for the probe's end: the probe waits at its gate
        gate.set()
        assert runner.wait_probed(60)
        assert runner.call("read", lambda: "answered", None) == "answered"
    lines = [(r.getMessage(), r.exc_info[0]) for r in caplog.records]
    assert lines == [("probe of tiered-progcache-probe test remote failed", ZeroDivisionError),
                     ("after the probe of tiered-progcache-probe test remote", IndexError)]


def test_a_failed_round_trip_after_the_probe_is_one_debug_line_and_ends_the_wait(caplog):
    def refused() -> None:
        raise ConnectionError("refused")

    runner = RequestRunner(MemoryFileSystem(), timeout=60, breaker=CircuitBreaker(), name="test remote")
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.stores.runner"):
        runner.start_probe(lambda: None, refused)
        assert runner.wait_probed(60) and runner.latency.recorded == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        "the round trip after the probe of tiered-progcache-probe test remote failed: ConnectionError('refused')"]


def test_only_the_first_request_that_waits_for_the_probe_is_the_sample_and_a_batch_is_none():
    """Two reads and a batch wait for the probe: the first read is R's first sample; the probe's thread takes none."""
    store, fs = _held_store(timeout=60)
    readers = [threading.Thread(target=store.verify_entry, args=(entry_name(bytes([n])),)) for n in range(2)]
    batch = threading.Thread(target=store.read_many, args=([entry_name(b"x"), entry_name(b"y")],))
    done = _watch_waits_for(store.runner)
    try:
        for thread in (*readers, batch):
            thread.start()
        assert done.waited_on_by(*readers, batch), "the requests never waited for the probe"
    finally:
        fs.probe_gate.set()
    for thread in (*readers, batch):
        thread.join(60)
    assert store.wait_ready(60)
    assert [op for op, _ in fs.seen].count("probe") == 2  # the probe's own two requests only
    assert store.runner.latency.recorded == 2  # both reads are timed; neither waits for a third request


def test_the_probes_own_requests_do_not_wait_for_it():
    fs = HeldProbeFileSystem()
    fs.mkdir("bucket")
    fs.probe_gate.set()
    store = RemoteProgramCache(fs, "bucket/kernels", timeout=3600)  # were it to wait for itself: an hour
    assert store.wait_ready(60)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_wait_for_its_parents_probe():
    """The probe's thread is not in the child, so nothing there would ever end it."""
    store, fs = _held_store(timeout=3600)
    try:
        pid = os.fork()
        if pid == 0:  # the child: answer with the exit code, never return into pytest
            os._exit(0 if store.wait_ready(0) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not store.wait_ready(0)  # the parent's is still held
    finally:
        fs.probe_gate.set()


def test_strict_probes_in_the_constructor():
    fs = HeldProbeFileSystem()
    fs.mkdir("bucket")
    fs.probe_gate.set()
    store = RemoteProgramCache(fs, "bucket/kernels", strict=True)
    assert store.wait_ready(0) and [op for op, _ in fs.seen] == ["probe", "probe"]


def test_what_waits_for_the_probe_is_called_once_it_ends_and_at_once_after():
    store, fs = _held_store()
    called: list[str] = []
    store.when_ready(lambda: called.append("early"))
    assert called == []
    fs.probe_gate.set()
    assert store.wait_ready(float("inf"))  # any timeout a caller passes is one the platform takes
    store.when_ready(lambda: called.append("late"))
    assert called == ["early", "late"]


def test_a_failed_background_probe_opens_the_breaker_counts_one_error_and_is_remembered(tmp_path):
    """A chain built on a dead remote: the probe's failure reaches the breaker, the tier's ``errors`` and the
    down memo once the probe ends, as the constructor's probe did."""
    memo = DownMemo(tmp_path / "local")
    cache = TieredProgramCache(tmp_path / "local", remote="s3://no-such-bucket-here/kernels",
                               remote_options={"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
                               remote_timeout=2)  # fmt: skip
    shared = cache.shared_store
    assert shared is not None and shared.wait_ready(60)
    assert not shared.available
    assert cache.stats()["remote"].errors == 1
    assert memo.recall("s3://no-such-bucket-here/kernels") is not None


def test_a_kernel_that_would_race_an_unknown_r_waits_for_the_probe_at_most_c_over_k_then_plans_with_r():
    """R unknown (50 ms assumed) would race a cheap kernel; a store near enough for the lease (R under C / k)
    answers its probe within about C / k, so the plan waits that long, no longer: a far store costs the
    kernel that wait, then it races. Where no R could make it take the lease, it does not wait."""
    from cuda.core.utils import InMemoryProgramCache

    from tiered_progcache.cluster.singleflight import plan

    store, fs = _held_store(timeout=60)
    with TieredProgramCache(tiers=[InMemoryProgramCache(), store]) as cache:
        shared = cache.shared_store
        asked, real_wait = _record_waits(shared)
        assert cache.flight_policy.lease_min_compile_rtts == 4
        assert plan(cache, 0.02) == ("short", None)  # the probe still held: the wait ended, the kernel races
        assert asked == [0.02 / 4]
        every_kernel_races = TieredProgramCache(tiers=[InMemoryProgramCache(), store], lease_min_compile_rtts=1e300)
        assert every_kernel_races.shared_store is shared
        assert plan(every_kernel_races, 1e298) == ("short", None)
        assert asked == [0.02 / 4, 1e298 / 1e300]
        never_uploaded = TieredProgramCache(tiers=[InMemoryProgramCache(), store], min_upload_compile_s=1.0)
        assert plan(never_uploaded, 0.5) == ("short", None) and len(asked) == 2  # races whatever R is: no wait
        always_leased = TieredProgramCache(tiers=[InMemoryProgramCache(), store], lease_min_compile_rtts=0)
        assert plan(always_leased, 0.001) == ("node", None) and len(asked) == 2  # no atomic create: node lock

        def opening_wait(timeout: float | None = None) -> bool:  # the probe answers during the wait
            asked.append(timeout)
            fs.probe_gate.set()
            return real_wait(60)

        shared.wait_ready = opening_wait
        case, rtt = plan(cache, 0.03)
        assert asked[2:] == [0.03 / 4] and rtt is not None and rtt == shared.round_trip_s
        assert case == ("short" if cache.flight_policy.short(0.03, rtt) else "node")  # no atomic create: node lock
        assert plan(cache, 1e300) == ("node", rtt) and len(asked) == 3  # R known: no wait


def test_the_probes_request_is_no_round_trip_and_one_more_request_after_it_is_the_first():
    """The probe's request opens the connection (TCP, TLS, the client's first use: 4-7 round trips on S3 and
    Redis), so it is not a sample of ``R``; one more request, once the probe has ended, is the first."""
    store, fs = _held_store(timeout=60)
    try:
        assert not store.wait_ready(0)
        assert store.runner.latency.recorded == 0
    finally:
        fs.probe_gate.set()  # the probe's request, however long it was held, is not timed
    assert store.wait_ready(60)
    assert [op for op, _ in fs.seen] == ["probe", "probe", "probe"] and store.runner.latency.recorded == 1


def test_a_directory_stores_first_sample_is_one_more_look_at_its_root(tmp_path, monkeypatch):
    """On a directory store (``file://``, NFS) the probe looks for the root; the first sample of ``R`` is one
    more look at the root, taken on the probe's thread when no request waited for the probe."""
    from tiered_progcache.stores import remote

    root = tmp_path / "remote"
    root.mkdir()
    looked: list[str] = []
    real_is_dir = remote._Objects.is_dir

    async def is_dir(self: Any, path: str) -> bool:
        looked.append(path)
        return await real_is_dir(self, path)

    monkeypatch.setattr(remote._Objects, "is_dir", is_dir)
    store = RemoteProgramCache.from_url(f"file://{root}", timeout=60)
    try:
        assert store.wait_ready(60) and store.available
        assert store.runner.latency.recorded == 1 and store.round_trip_s is not None
    finally:
        store.close()
    assert looked == [store.root, store.root]  # the probe's look (the root is there), then the sample's


def test_a_store_found_down_by_its_probe_takes_no_round_trip_sample():
    """Nothing is asked of a store its probe found down (the breaker open): ``R`` stays unknown."""
    breaker = CircuitBreaker(failure_threshold=1)
    fs = HeldProbeFileSystem()  # no bucket: the probe fails
    store = RemoteProgramCache(fs, "bucket/kernels", timeout=60, breaker=breaker)
    fs.probe_gate.set()
    assert store.wait_ready(60)
    assert not store.available and store.round_trip_s is None
    assert [op for op, _ in fs.seen] == []  # no bucket to hold: the probe failed before it reached the gate


def test_wait_probed_without_a_timeout_waits_for_the_sample():
    """What the boot fetch calls: no deadline of its own (each request has one)."""
    gate = threading.Event()
    runner = RequestRunner(MemoryFileSystem(), timeout=60, breaker=CircuitBreaker(), name="test remote")
    runner.start_probe(lambda: None, lambda: gate.wait(60))
    assert not runner.wait_probed(0)
    gate.set()
    assert runner.wait_probed() is True


def test_close_gives_a_probe_still_in_flight_one_request_deadline_not_more():
    held = threading.Event()
    runner = RequestRunner(MemoryFileSystem(), timeout=0.05, breaker=CircuitBreaker(), name="test remote")
    runner.start_probe(held.wait)  # stuck: only a bug could hold a probe past its deadlines
    try:
        closer = threading.Thread(target=runner.close)
        closer.start()
        closer.join(60)  # one deadline (50 ms) is the wait; an hour would be the bug
        assert not closer.is_alive() and not runner.wait_probed(0)
    finally:
        held.set()


def test_a_stuck_probe_never_holds_the_interpreters_exit():
    held = threading.Event()
    runner = RequestRunner(MemoryFileSystem(), timeout=60, breaker=CircuitBreaker(), name="held remote")
    runner.start_probe(held.wait)
    try:
        (probe,) = [t for t in threading.enumerate() if t.name == "tiered-progcache-probe held remote"]
        assert probe.daemon
    finally:
        held.set()


def test_a_store_on_a_shared_breaker_that_tripped_and_recovered_probes_and_says_nothing_of_being_down(caplog):
    """``breaker`` may be shared with other stores: one tripped at another store's construction, then closed by a
    success, keeps what tripped it; a store built on it now is not down: its probe goes out, no WARNING."""
    breaker = CircuitBreaker(name="shared breaker")
    breaker.trip(OSError("down at the first store's construction"))
    breaker.record_success()
    assert breaker.state == "closed" and breaker.tripped_by is not None
    caplog.set_level(logging.WARNING, logger="tiered_progcache")
    caplog.clear()
    store, fs = _held_store(breaker=breaker)
    fs.probe_gate.set()
    assert store.wait_ready(60)
    assert fs.seen[0] == ("probe", False) and store.available
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    store.close()


def test_the_boot_fetch_lists_once_the_probe_answered_not_after_rs_first_sample(tmp_path):
    """The boot fetch lists as soon as the probe has answered, beside the first lookup's own request: a
    round-trip sample still out (claimed here and held, under a 60 s deadline) keeps it back not at all."""
    store, fs = _held_store(timeout=60)
    cache = _chain_over(store, tmp_path)
    probe = _answer_the_probe_and_hold_the_sample(store, fs)
    try:
        asked, real_wait = _record_waits(store)
        assert cache.get(b"k" * 32) is None  # the first lookup at the shared tier starts the boot fetch
        assert cache._boot.wait(60)  # it listed and finished, the sample still out
        assert asked == [] and not real_wait(0)  # it never waited for the sample
        assert cache._boot.report == (0, None)
    finally:
        probe.sampled()
        cache.close()


def test_the_boot_fetch_lists_beside_a_probe_still_out(tmp_path):
    """The listing goes out while the store's first probe is still held at its gate (a round trip sooner than
    after it): the fetch lists the empty store and ends before the probe has answered."""
    store, fs = _held_store(timeout=60)
    cache = _chain_over(store, tmp_path)
    lookup = threading.Thread(target=cache.get, args=(b"k" * 32,))  # the first lookup: it waits for the probe
    try:
        lookup.start()
        assert cache._boot.wait(60)  # listed and ended, the probe still held
        assert sorted(fs.seen) == sorted([*PROBE_HELD, ("list", False)]) and not fs.probe_answered
        assert cache._boot.report == (0, None)
    finally:
        fs.probe_gate.set()
        lookup.join(60)
        cache.close()


def test_a_listing_that_failed_beside_a_probe_that_found_the_store_down_is_not_a_second_warning(tmp_path, caplog):
    """One fault, one warning: the probe's. The boot fetch's listing, out beside it, failed too; its line
    waits for the probe's verdict and, the store found down, is INFO."""
    store, fs = _held_store(timeout=60)
    fs.probe_fails = fs.listing_fails = True
    cache = _chain_over(store, tmp_path)
    lookup = threading.Thread(target=cache.get, args=(b"k" * 32,))
    try:
        with caplog.at_level(logging.INFO, logger="tiered_progcache"):
            lookup.start()
            assert fs.listing_made.wait(60)  # the listing was made (and fails) while the probe is held
            assert not cache._boot.wait(0)  # it waits for the probe's verdict before saying anything
            fs.probe_gate.set()
            assert cache._boot.wait(60) and store.wait_ready(60) and not store.available
    finally:
        fs.probe_gate.set()
        lookup.join(60)
        cache.close()
    fetch = [r for r in caplog.records if r.name == "tiered_progcache.chain.bootfetch"]
    assert [(r.levelno, r.getMessage().split(": ")[-1]) for r in fetch] == [
        (logging.INFO, "the store is down")], fetch
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "is unreachable: its endpoint refused the connection" in warnings[0], warnings


def test_a_listing_answered_after_the_probe_found_the_store_down_leaves_the_breaker_open(tmp_path, caplog):
    """The probe is the one that says whether the store works: a listing sent beside it and answered after
    it tripped the breaker (an absent root answers "nothing there") does not close it again, so nothing
    is uploaded to a store the probe refused, and no "reachable again" is logged."""
    store, fs = _held_store(timeout=60)
    fs.probe_fails = True
    fs.listing_gate.clear()
    cache = _chain_over(store, tmp_path)
    lookup = threading.Thread(target=cache.get, args=(b"k" * 32,))
    try:
        with caplog.at_level(logging.INFO, logger="tiered_progcache"):
            lookup.start()
            assert fs.listing_made.wait(60)  # out beside the probe, held before it answers
            fs.probe_gate.set()
            assert store.wait_ready(60) and not store.available  # the probe found the store down
            fs.listing_gate.set()
            assert cache._boot.wait(60) and cache._boot.report == (0, None)  # the listing answered: nothing
            assert not store.available and store.breaker.state == "open"
    finally:
        fs.probe_gate.set()
        fs.listing_gate.set()
        lookup.join(60)
        cache.close()
    assert not [r for r in caplog.records if "reachable again" in r.getMessage()]


def test_a_request_beside_the_probe_while_the_breaker_is_not_closed_waits_for_the_probe_as_any_request():
    """Beside the probe only while the breaker is closed: on a store coming back from a cooldown (its probe
    the one call that may go) a listing made beside the probe waits for it, then goes and is booked."""
    now = [0.0]
    breaker = CircuitBreaker(cooldown_s=10, name="remote cache slow://bucket/kernels", clock=lambda: now[0])
    breaker.trip(OSError("down a cooldown ago"))
    now[0] = 11.0  # the cooldown is over: the probe may go (and holds the breaker while it is out)
    store, fs = _held_store(timeout=60, breaker=breaker)
    listed: list[Any] = []

    def list_beside() -> None:
        with store.beside_probe():
            listed.append(list(store.iter_entries()))

    lister = threading.Thread(target=list_beside)
    try:
        assert fs.wait_seen(len(PROBE_HELD))  # the probe is out, at its gate
        done = _watch_waits_for(store.runner)
        lister.start()
        assert done.waited_on_by(lister), "the listing never waited for the probe"
        assert not fs.listing_made.is_set()
        fs.probe_gate.set()
        lister.join(60)
        assert listed == [[]] and ("list", True) in fs.seen and breaker.state == "closed"
    finally:
        fs.probe_gate.set()
        store.close()


def test_a_failed_listing_waits_for_the_probes_verdict_at_most_one_request_deadline(tmp_path, caplog):
    """The failed listing's line waits for the probe, but a round-trip sample that never ends (claimed here
    and held) keeps it back one request deadline of the store's (0.5 s), not the setting's, not for ever."""
    store, fs = _held_store(timeout=0.5)
    fs.listing_fails = True
    cache = _chain_over(store, tmp_path)
    probe = _answer_the_probe_and_hold_the_sample(store, fs)
    try:
        asked, real_wait = _record_waits(store)
        with caplog.at_level(logging.WARNING, logger="tiered_progcache.chain.bootfetch"):
            assert cache.get(b"k" * 32) is None  # the first lookup at the shared tier starts the boot fetch
            assert cache._boot.wait(60) and not real_wait(0)  # it ended, the sample still out
        assert asked == [0.5]
        assert [r.getMessage().rsplit(": ", 1)[-1] for r in caplog.records] == ["the store is down"]
    finally:
        probe.sampled()
        cache.close()


def test_a_request_after_the_beside_block_waits_for_the_probe_again():
    """``beside_probe`` holds for its block only: the same thread's next request waits for the probe."""
    store, fs = _held_store(timeout=60)
    read: list[Any] = []

    def after_the_block() -> None:
        with store.beside_probe():
            pass
        read.append(store.verify_entry(entry_name(b"k")))

    thread = threading.Thread(target=after_the_block)
    try:
        done = _watch_waits_for(store.runner)
        thread.start()
        assert done.waited_on_by(thread), "the request after the block did not wait for the probe"
        assert not read
    finally:
        fs.probe_gate.set()
        thread.join(60)
        store.close()
    assert read == ["missing"]


@pytest.mark.parametrize("recorded", [False, True])
def test_a_kernels_direct_manifest_is_read_beside_a_probe_still_out(tmp_path, recorded):
    """A fresh node's first request, where its first kernel reads headers, is its direct manifest's read: it
    goes out while the store's first probe is still held (a round trip sooner than after it), and, found or
    not, is no sample of ``R`` (its connection may be new). The key is made with the probe still out."""
    from cuda.core import ProgramOptions

    from tiered_progcache.compiling import direct

    include = tmp_path / "include"
    include.mkdir()
    (include / "h.h").write_text("#define H 1\n")
    source = '#include "h.h"\n__global__ void k() {}\n'
    options = ProgramOptions(arch="sm_90", include_path=[str(include)])
    fs = HeldProbeFileSystem()
    fs.mkdir("bucket")
    if recorded:  # another node compiled it: its direct manifest is on the store
        fs.probe_gate.set()
        writer = _chain_over(RemoteProgramCache(fs, "bucket/kernels", timeout=60), tmp_path / "writer")
        made = direct.compile_key(writer, source, "c++", options, "cubin")
        assert direct.record(writer, made, source, "c++", options, "cubin", (), None)
        writer.close()
        fs.probe_gate.clear()
        fs.probe_answered = False
        fs.seen.clear()
    store = RemoteProgramCache(fs, "bucket/kernels", timeout=60)
    cache = _chain_over(store, tmp_path)
    try:
        compiled = direct.compile_key(cache, source, "c++", options, "cubin")
        assert ("read", False) in fs.seen and not fs.probe_answered
        assert compiled.unrecorded is not recorded and compiled.header_digest is not None
        assert store.round_trip_s is None
    finally:
        fs.probe_gate.set()
        cache.close()
