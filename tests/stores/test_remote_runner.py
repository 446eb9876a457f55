"""The remote's one door: RequestRunner's deadlines and breaker bookkeeping, bulk batches and lease requests included."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from tiered_progcache import TierUnavailable
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.runner import BatchOutcome, RequestRunner
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401
from tiered_progcache.testing.slowfs import SlowFileSystem
from support import FakeClock


def _half_open(clock: FakeClock) -> CircuitBreaker:
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=30, clock=clock)
    breaker.trip(ConnectionError("down"))
    clock.now += 31
    assert breaker.state == "half-open"
    return breaker


def _blocking_runner(breaker: CircuitBreaker, timeout: float = 5.0) -> RequestRunner:
    return RequestRunner(MemoryFileSystem(), timeout=timeout, breaker=breaker, name="test remote")


def _fail(n: int) -> int:
    raise ConnectionError(f"request {n} failed")


# -- the bulk path ------------------------------------------------------------------------


def test_bulk_records_a_half_open_probes_failure():
    clock = FakeClock()
    breaker = _half_open(clock)
    runner = _blocking_runner(breaker)
    got = runner.call_many("batch", _fail, None, {n: (n,) for n in range(5)})
    assert got.results == {} and sorted(got.errors) == [0, 1, 2, 3, 4]  # every request went out
    assert all(isinstance(e, ConnectionError) for e in got.errors.values())
    assert breaker.state == "open"  # the probe failed: another cooldown
    clock.now += 31
    assert breaker.state == "half-open"  # and a later probe may go: the breaker is not stuck open
    runner.close()


def test_bulk_records_a_half_open_probes_success():
    clock = FakeClock()
    breaker = _half_open(clock)
    runner = _blocking_runner(breaker)
    assert runner.call_many("batch", lambda n: n * 2, None, {n: (n,) for n in range(5)}) == BatchOutcome(
        {0: 0, 1: 2, 2: 4, 3: 6, 4: 8}
    )
    assert breaker.state == "closed"
    runner.close()


def test_bulk_a_miss_is_an_answer_and_one_answer_means_the_remote_works():
    clock = FakeClock()
    breaker = _half_open(clock)
    runner = _blocking_runner(breaker)

    def some_missing(n: int) -> int:
        if n == 0:
            raise FileNotFoundError(n)
        raise ConnectionError(n)

    got = runner.call_many("batch", some_missing, None, {n: (n,) for n in range(3)})
    assert got.results == {} and isinstance(got.errors[0], FileNotFoundError) and isinstance(got.errors[2], ConnectionError)
    assert breaker.state == "closed"
    runner.close()


def test_bulk_abandoned_by_an_interrupt_still_records_the_probe():
    clock = FakeClock()
    breaker = _half_open(clock)
    runner = _blocking_runner(breaker)

    def interrupted(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.call_many("batch", interrupted, None, {0: (0,), 1: (1,)})
    assert breaker.state == "open"
    clock.now += 31
    assert breaker.state == "half-open"
    runner.close()


def test_bulk_on_an_open_breaker_sends_nothing():
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=30)
    breaker.trip(ConnectionError("down"))
    runner = _blocking_runner(breaker)
    sent = []
    got = runner.call_many("batch", sent.append, None, {1: (1,), 2: (2,)})
    assert sent == [] and got.results == {} and all(isinstance(e, TierUnavailable) for e in got.errors.values())
    assert sorted(got.errors) == [1, 2]


def test_bulk_that_fails_whole_opens_a_closed_breaker():
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=30)
    runner = _blocking_runner(breaker)
    runner.call_many("batch", _fail, None, {n: (n,) for n in range(4)})
    assert breaker.state == "open"  # each failed request counted
    runner.close()


def test_bulk_on_a_blocking_filesystem_times_out_as_one_batch():
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=30)
    runner = _blocking_runner(breaker, timeout=0.1)
    release = threading.Event()
    started = time.monotonic()
    try:
        got = runner.call_many("batch", lambda n: release.wait(), None, {n: (n,) for n in range(3)}, timeout=0.3)
    finally:
        release.set()
    assert time.monotonic() - started < 3
    assert got.results == {} and len(got.errors) == 3 and all(isinstance(e, TimeoutError) for e in got.errors.values())
    assert breaker.state == "open"
    runner.close()


def test_bulk_on_an_async_filesystem_is_cancelled_at_its_deadline_and_records_the_probe():
    clock = FakeClock()
    breaker = _half_open(clock)
    fs = SlowFileSystem(delay_s=3600)
    fs.mkdir("bucket")
    runner = RequestRunner(fs, timeout=5, breaker=breaker, name="slow")  # the batch below gives its own 0.2 s
    assert runner.is_async
    started = time.monotonic()
    got = runner.call_many("batch", fs.cat_file, fs._cat_file, {"a": ("bucket/a",), "b": ("bucket/b",)}, timeout=0.2)
    assert time.monotonic() - started < 3
    assert got.results == {} and len(got.errors) == 2 and all(isinstance(e, TimeoutError) for e in got.errors.values())
    assert breaker.state == "open"
    fs.delay_s = 0
    fs.pipe_file("bucket/a", b"A")
    clock.now += 31
    got = runner.call_many("batch", fs.cat_file, fs._cat_file, {"a": ("bucket/a",), "b": ("bucket/b",)})
    assert got.results == {"a": b"A"} and list(got.errors) == ["b"] and isinstance(got.errors["b"], FileNotFoundError)
    assert breaker.state == "closed"


def test_bulk_on_an_async_filesystem_raises_a_request_cancelled_on_its_own_once_the_breaker_counted_the_batch():
    """``gather`` hands a cancelled request back in its list; the batch raises it (as ``call`` would), never returns it."""
    fs = SlowFileSystem()
    runner = RequestRunner(fs, timeout=5, breaker=CircuitBreaker(failure_threshold=1), name="slow")

    async def answer_or_cancelled(n: int) -> int:
        if n == 1:
            raise asyncio.CancelledError
        return n

    with pytest.raises(asyncio.CancelledError):
        runner.call_many("batch", lambda n: n, answer_or_cancelled, {0: (0,), 1: (1,)})
    assert runner.breaker.state == "closed"  # one request was answered: the remote works


# -- the thread pool -----------------------------------------------------------------------


def _pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"tiered-progcache-remote {name}-")]


def test_the_pool_never_grows_past_its_maximum_and_reuses_idle_threads():
    name = f"pool-{uuid.uuid4().hex[:8]}"
    runner = RequestRunner(
        MemoryFileSystem(), timeout=5, breaker=CircuitBreaker(failure_threshold=100), name=name, max_threads=2
    )
    gate = threading.Event()
    try:
        got = runner.call_many("batch", lambda n: gate.wait(), None, {n: (n,) for n in range(5)}, timeout=0.2)
        assert len(got.errors) == 5 and all(isinstance(e, TimeoutError) for e in got.errors.values())
        assert len(_pool_threads(name)) == 2  # five hung requests, two threads: the rest waited in the queue
    finally:
        gate.set()
    for _ in range(3):  # the two threads come free and serve what follows; no third is started
        assert runner.call("op", lambda: threading.current_thread().name, None).startswith(f"tiered-progcache-remote {name}-")
    assert len(_pool_threads(name)) == 2
    runner.close()


def test_a_closed_runner_still_serves_requests_on_fresh_threads():
    name = f"pool-{uuid.uuid4().hex[:8]}"
    runner = RequestRunner(MemoryFileSystem(), timeout=5, breaker=CircuitBreaker(), name=name, max_threads=1)
    assert runner.call("op", lambda: 1, None) == 1
    runner.close()
    assert runner.call("op", lambda: 2, None) == 2


def test_a_request_that_outlives_its_deadline_is_a_timeout_error_naming_it():
    runner = RequestRunner(MemoryFileSystem(), timeout=0.1, breaker=CircuitBreaker(), name="remote Z")
    gate = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="read on remote Z took longer than 0.1 s"):
            runner.call("read", gate.wait, None)
    finally:
        gate.set()
    with pytest.raises(ValueError, match="max_threads"):
        RequestRunner(MemoryFileSystem(), timeout=1, breaker=CircuitBreaker(), name="x", max_threads=0)
    with pytest.raises(ValueError, match="^RequestRunner needs a filesystem or a factory to build one$"):
        RequestRunner(None, timeout=1, breaker=CircuitBreaker(), name="x")
    runner.close()


def test_batch_timeout_scales_with_the_batch():
    runner = RequestRunner(MemoryFileSystem(), timeout=2.0, breaker=CircuitBreaker(), name="x")
    assert [runner.batch_timeout(n) for n in (1, 16, 32, 33, 64, 65)] == [4.0, 4.0, 4.0, 6.0, 8.0, 10.0]


# -- single requests ----------------------------------------------------------------------


def test_call_records_success_failure_and_answers():
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=30)
    runner = _blocking_runner(breaker)
    assert runner.call("op", lambda: 42, None) == 42
    for answer in (FileNotFoundError, FileExistsError):

        def raises(answer=answer):
            raise answer("answer")

        with pytest.raises(answer):
            runner.call("op", raises, None)
    assert breaker.consecutive_failures == 0
    for _ in range(2):
        with pytest.raises(ConnectionError):
            runner.call("op", _fail, None, 0)
    with pytest.raises(TierUnavailable):
        runner.call("op", lambda: 42, None)
    runner.close()


def test_remote_batches_go_through_its_runner():
    fs = SlowFileSystem()
    fs.mkdir("bucket")
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=30)
    remote = RemoteProgramCache(fs, "bucket/kernels", breaker=breaker)
    assert remote.wait_ready(60)  # its probe's success would close the breaker tripped below
    assert remote.runner.breaker is breaker and remote.available
    breaker.trip(ConnectionError("down"))
    assert not remote.available
    fs.requests.clear()
    got = remote.read_envelopes(["ab" * 32])
    assert isinstance(got.errors["ab" * 32], TierUnavailable) and sum(fs.requests.values()) == 0


# -- leases --------------------------------------------------------------------------------


def _lease_roundtrip(remote: RemoteProgramCache) -> None:
    leases = remote.leases()
    assert leases is not None and leases.atomic_create is True
    assert leases.read("n") is None
    assert leases.create("n", b"first", 10) is True
    assert leases.create("n", b"second", 10) is False
    assert leases.read("n") == b"first"
    leases.replace("n", b"renewed", 10)
    assert leases.read("n") == b"renewed"
    leases.delete("n")
    leases.delete("n")  # already gone: no error
    assert leases.read("n") is None
    assert remote.breaker.state == "closed"  # FileExistsError and misses are answers, not failures
    with pytest.raises(ValueError):
        leases.create("../escape", b"x", 10)


def test_leases_on_memory(tmp_path):
    remote = RemoteProgramCache.from_url(f"memory://leases-{uuid.uuid4().hex}/k", strict=True)
    assert remote.atomic_create is True
    _lease_roundtrip(remote)
    remote.clear()


def test_leases_on_a_file_url_link_into_place(tmp_path):
    remote = RemoteProgramCache.from_url((tmp_path / "nfs").as_uri(), strict=True)
    assert remote.atomic_create is True
    leases = remote.leases()
    assert leases.location == f"{remote.location}/leases"
    assert leases.create("n", b"doc", 10) is True
    assert (tmp_path / "nfs" / "leases" / "n").read_bytes() == b"doc"
    assert list((tmp_path / "nfs" / "tmp").iterdir()) == []  # staged, linked, unstaged
    leases.delete("n")
    _lease_roundtrip(remote)


def test_leases_on_s3(s3_bucket):
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True)
    assert remote.atomic_create is True
    _lease_roundtrip(remote)


def test_no_leases_on_a_read_only_remote():
    url = f"memory://leases-{uuid.uuid4().hex}/k"
    RemoteProgramCache.from_url(url, strict=True)
    assert RemoteProgramCache.from_url(url, read_only=True).leases() is None


def test_a_filesystem_without_conditional_create_says_so():
    fs = SlowFileSystem()  # its pipe_file(mode="create") is not declared atomic: fsspec's generic one is not
    fs.mkdir("bucket")
    remote = RemoteProgramCache(fs, "bucket/kernels")
    assert remote.atomic_create is False and remote.leases().atomic_create is False
    name = "cd" * 32
    assert remote.create_entry(name, b"x") is True  # check, then put
    assert remote.create_entry(name, b"y") is False
    assert remote.read_entry(name) == b"x"


def test_lease_requests_go_through_the_breaker():
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=30)
    remote = RemoteProgramCache.from_url(f"memory://leases-{uuid.uuid4().hex}/k", breaker=breaker)
    assert remote.wait_ready(60)  # its probe's success would close the breaker tripped below
    breaker.trip(ConnectionError("down"))
    leases = remote.leases()
    for attempt in (
        lambda: leases.create("n", b"x", 10),
        lambda: leases.read("n"),
        lambda: leases.replace("n", b"x", 10),
        lambda: leases.delete("n"),
    ):
        with pytest.raises(TierUnavailable):
            attempt()


def test_location_never_holds_a_password():
    remote = RemoteProgramCache.from_url(f"memory://user:s3cret@leases-{uuid.uuid4().hex}/k")
    assert "s3cret" not in remote.location and "s3cret" not in repr(remote) and remote.location.startswith("memory://user:***@")


# -- explicit deadlines, the request's own timeouts, building the filesystem -------------


def test_an_explicit_timeout_overrides_the_runners_own():
    runner = RequestRunner(MemoryFileSystem(), timeout=60, breaker=CircuitBreaker(), name="remote Y")
    gate = threading.Event()
    try:
        with pytest.raises(TimeoutError, match=r"^op on remote Y took longer than 0.1 s$"):
            runner.call("op", gate.wait, None, timeout=0.1)
        got = runner.call_many("batch", lambda n: gate.wait(), None, {1: (1,), 2: (2,)}, timeout=0.1)
        assert {k: str(e) for k, e in got.errors.items()} == dict.fromkeys([1, 2], "batch on remote Y took longer than 0.1 s")
    finally:
        gate.set()
    runner.close()


def test_a_requests_own_timeout_error_is_passed_on_as_it_is():
    breaker = CircuitBreaker(failure_threshold=5)
    runner = RequestRunner(MemoryFileSystem(), timeout=5, breaker=breaker, name="remote Y")

    def socket_timeout(n: int = 0) -> None:
        raise TimeoutError(f"socket timed out {n}")

    with pytest.raises(TimeoutError, match=r"^socket timed out 0$"):
        runner.call("op", socket_timeout, None)
    got = runner.call_many("batch", socket_timeout, None, {1: (1,), 2: (2,)})
    assert {k: str(e) for k, e in got.errors.items()} == {1: "socket timed out 1", 2: "socket timed out 2"}
    assert breaker.consecutive_failures == 3
    runner.close()


class _Unbuildable(MemoryFileSystem):
    cachable = False

    def __init__(self, *args, **kwargs):
        raise ConnectionError("cannot connect")


def test_a_filesystem_that_cannot_be_built_fails_the_request_and_is_recorded():
    from tiered_progcache.stores.runner import FilesystemFactory

    breaker = CircuitBreaker(failure_threshold=3)
    runner = RequestRunner(None, timeout=5, breaker=breaker, name="remote W", factory=FilesystemFactory(_Unbuildable, {}))
    with pytest.raises(ConnectionError, match="cannot connect"):
        runner.call("op", lambda: 1, None)
    got = runner.call_many("batch", lambda n: n, None, {1: (1,), 2: (2,)})
    assert got.results == {} and {k: str(e) for k, e in got.errors.items()} == {1: "cannot connect", 2: "cannot connect"}
    assert breaker.consecutive_failures == 2
    with pytest.raises(ConnectionError, match="cannot connect"):
        runner.fs
    assert breaker.state == "open"
    with pytest.raises(TierUnavailable, match=r"last: ConnectionError: cannot connect"):
        runner.fs


def test_a_factory_rebuilds_from_storage_options_and_fresh_skips_fsspecs_cache():
    from tiered_progcache.stores.runner import FilesystemFactory

    fs = SlowFileSystem(delay_s=0.5)
    factory = FilesystemFactory.like(fs)
    assert factory.cls is SlowFileSystem and dict(factory.kwargs) == {"delay_s": 0.5} and factory.is_async
    assert dict(factory.storage_options) == {"delay_s": 0.5}  # what the tier reads its endpoint from
    assert factory.build().delay_s == 0.5
    assert FilesystemFactory(MemoryFileSystem, {}).build() is MemoryFileSystem()  # fsspec's cached instance
    assert FilesystemFactory(MemoryFileSystem, {}).build(fresh=True) is not MemoryFileSystem()
    fresh = FilesystemFactory(MemoryFileSystem, {})
    assert fresh.build(fresh=True) is not fresh.build(fresh=True)  # neither taken from, nor put in, the cache
    assert fresh.build(fresh=True).storage_options == {}  # the cache switch is fsspec's, not a storage option
    assert not FilesystemFactory(MemoryFileSystem, {}).is_async


# -- stop flags, deadlines of a batch, the names in timeouts, fork ---------------------------------


def test_a_stoppable_call_gets_a_stop_flag_first_and_it_is_set_when_its_caller_stops_waiting():
    runner = RequestRunner(MemoryFileSystem(), timeout=5, breaker=CircuitBreaker(), name="remote S")
    flags: list[threading.Event] = []

    def read(stop: threading.Event, path: str) -> str:
        flags.append(stop)
        return path

    assert runner.call("read", read, None, "a", stoppable=True) == "a"
    assert isinstance(flags[0], threading.Event) and not flags[0].is_set()
    ended = threading.Event()

    def long_read(stop: threading.Event) -> None:
        flags.append(stop)
        stop.wait(60)  # a chunked read checks its flag between chunks; this one waits on it
        ended.set()

    with pytest.raises(TimeoutError, match=r"^read on remote S took longer than 0.1 s$"):
        runner.call("read", long_read, None, stoppable=True, timeout=0.1)
    assert ended.wait(30) and flags[1].is_set()  # told to stop, it stopped
    assert runner.call_many("batch", read, None, {"x": ("x",), "y": ("y",)}, stoppable=True) == BatchOutcome({"x": "x", "y": "y"})
    assert flags[2] is flags[3] and not flags[2].is_set()  # one flag for the batch, not set when all answered
    runner.close()


def test_a_batch_waits_up_to_its_deadline_for_requests_still_running():
    runner = RequestRunner(MemoryFileSystem(), timeout=5, breaker=CircuitBreaker(), name="remote B")
    gate = threading.Event()
    threading.Timer(0.05, gate.set).start()  # the requests end while the batch waits
    assert runner.call_many("batch", lambda n: gate.wait(30) and n, None, {1: (1,), 2: (2,)}, timeout=30).results == {1: 1, 2: 2}
    runner.close()


def test_an_async_request_past_its_deadline_is_a_timeout_error_naming_it():
    fs = SlowFileSystem(delay_s=3600)
    fs.mkdir("bucket")
    runner = RequestRunner(fs, timeout=0.1, breaker=CircuitBreaker(failure_threshold=10), name="slow X")
    with pytest.raises(TimeoutError, match=r"^read on slow X took longer than 0.1 s$"):
        runner.call("read", fs.cat_file, fs._cat_file, "bucket/a")
    got = runner.call_many("batch", fs.cat_file, fs._cat_file, {"a": ("bucket/a",)}, timeout=0.1)
    assert {k: str(e) for k, e in got.errors.items()} == {"a": "batch on slow X took longer than 0.1 s"}
    fs.delay_s = 0


def test_after_a_fork_the_child_has_fresh_threads_and_rebuilds_a_filesystem_it_built(monkeypatch):
    """What the child of a fork runs (forks themselves: test_remote_fork.py); called here directly."""
    import weakref

    from tiered_progcache.stores import runner as runner_module
    from tiered_progcache.stores.runner import FilesystemFactory

    name = f"fork-{uuid.uuid4().hex[:8]}"
    built = RequestRunner(None, timeout=5, breaker=CircuitBreaker(), name=name, max_threads=1,
                          factory=FilesystemFactory(MemoryFileSystem, {}))  # fmt: skip
    handed = RequestRunner(SlowFileSystem(), timeout=5, breaker=CircuitBreaker(), name="handed async")
    blocking = RequestRunner(MemoryFileSystem(), timeout=5, breaker=CircuitBreaker(), name="handed blocking")
    parents = (built.fs, handed.fs, blocking.fs)
    gate = threading.Event()
    try:
        with pytest.raises(TimeoutError):  # the parent's one pool thread is stuck in a call
            built.call("op", gate.wait, None, timeout=0.05)
        monkeypatch.setattr(runner_module, "_RUNNERS", weakref.WeakSet([built, handed, blocking]))
        runner_module._after_fork_in_child()
        assert handed.fs is not parents[2] and isinstance(handed.fs, SlowFileSystem)  # async: rebuilt
        assert blocking.fs is parents[2]  # a blocking filesystem handed in holds no threads: kept
        names = []
        assert built.call("op", lambda: names.append(threading.current_thread().name) or 2, None) == 2
        assert names == [f"tiered-progcache-remote {name}-1"]  # a fresh pool: the stuck thread is the parent's
        assert isinstance(built.fs, MemoryFileSystem) and built.fs is not parents[0]  # built again in the child
        assert blocking.call("op", lambda: 3, None) == 3
    finally:
        gate.set()


def test_pool_threads_are_daemons_and_an_idle_one_takes_one_request_only():
    """Two requests that must run at once (a barrier of two) after one thread went idle: a second thread starts."""
    name = f"pool-{uuid.uuid4().hex[:8]}"
    runner = RequestRunner(MemoryFileSystem(), timeout=30, breaker=CircuitBreaker(), name=name, max_threads=3)
    assert runner.call("op", lambda: 1, None) == 1  # one thread
    deadline = time.monotonic() + 30
    while runner._threads._idle != 1:  # it counts itself idle just after handing back its result
        assert time.monotonic() < deadline
        time.sleep(0.001)
    together = threading.Barrier(2, timeout=10)
    assert runner.call_many("batch", lambda n: together.wait() >= 0 and n, None, {1: (1,), 2: (2,)}).results == {1: 1, 2: 2}
    threads = _pool_threads(name)
    assert len(threads) == 2 and all(t.daemon for t in threads)
    while runner._threads._idle != 2:  # both count themselves idle again
        assert time.monotonic() < deadline
        time.sleep(0.001)
    together = threading.Barrier(2, timeout=10)
    assert runner.call_many("batch", lambda n: together.wait() >= 0 and n, None, {3: (3,), 4: (4,)}).results == {3: 3, 4: 4}
    assert set(_pool_threads(name)) == set(threads)  # the two idle threads served it: none started
    runner.close()


def _last_error(runner: RequestRunner) -> str:
    """What the open breaker says it last saw (its refusal names it)."""
    with pytest.raises(TierUnavailable) as refused:
        runner.call("op", lambda: None, None)
    return str(refused.value)


def test_an_open_breaker_names_the_last_failure_of_a_batch_whole_failed_interrupted_or_unbuilt():
    from tiered_progcache.stores.runner import FilesystemFactory

    runner = _blocking_runner(CircuitBreaker(failure_threshold=4, cooldown_s=30))
    runner.call_many("batch", _fail, None, {n: (n,) for n in range(4)})
    assert "last: ConnectionError: request 3 failed" in _last_error(runner)

    def interrupted(n: int) -> None:
        raise KeyboardInterrupt("stop now")

    runner = _blocking_runner(CircuitBreaker(failure_threshold=1, cooldown_s=30))
    with pytest.raises(KeyboardInterrupt):
        runner.call_many("batch", interrupted, None, {0: (0,)})
    assert "last: KeyboardInterrupt: stop now" in _last_error(runner)

    runner = RequestRunner(None, timeout=5, breaker=CircuitBreaker(failure_threshold=1), name="remote W",
                           factory=FilesystemFactory(_Unbuildable, {}))  # fmt: skip
    assert {k: str(e) for k, e in runner.call_many("batch", lambda n: n, None, {1: (1,)}).errors.items()} == {1: "cannot connect"}
    assert "last: ConnectionError: cannot connect" in _last_error(runner)


def test_a_batch_runs_the_async_function_on_an_async_filesystem_and_the_blocking_one_otherwise():
    async def on_loop(n: int) -> str:
        return f"async {n}"

    fs = SlowFileSystem()
    async_runner = RequestRunner(fs, timeout=5, breaker=CircuitBreaker(), name="slow")
    assert async_runner.call_many("batch", lambda n: f"sync {n}", on_loop, {1: (1,)}).results == {1: "async 1"}
    assert async_runner.call_many("batch", lambda n: f"sync {n}", None, {2: (2,)}).results == {2: "sync 2"}  # none given
    blocking = _blocking_runner(CircuitBreaker())
    assert blocking.call_many("batch", lambda n: f"sync {n}", on_loop, {3: (3,)}).results == {3: "sync 3"}
    blocking.close()


def test_the_first_request_of_a_runner_that_builds_its_filesystem_is_timed_from_after_the_build():
    from tiered_progcache.stores.runner import FilesystemFactory

    runner = RequestRunner(None, timeout=5, breaker=CircuitBreaker(), name="remote L",
                           factory=FilesystemFactory(MemoryFileSystem, {}))  # fmt: skip
    assert runner.call("op", lambda: 7, None) == 7
    assert runner.latency.recorded == 1


def test_a_factory_like_an_object_without_storage_options_has_none():
    from tiered_progcache.stores.runner import FilesystemFactory

    class Bare:
        pass

    factory = FilesystemFactory.like(Bare())
    assert factory.cls is Bare and dict(factory.kwargs) == {}


def test_only_single_requests_under_the_runners_own_deadline_are_timed_answers_included():
    runner = _blocking_runner(CircuitBreaker())

    def missing() -> None:
        raise FileNotFoundError("no such entry")

    assert runner.call("op", lambda: 1, None) == 1
    with pytest.raises(FileNotFoundError):
        runner.call("op", missing, None)  # an answer: one round trip too
    assert runner.latency.recorded == 2
    assert runner.call("list", lambda: 2, None, timeout=60) == 2  # a listing's own deadline: not one round trip
    with pytest.raises(FileNotFoundError):
        runner.call("list", missing, None, timeout=60)
    assert runner.latency.recorded == 2
    assert 0 <= runner.latency.median() < 60  # a duration, not a point in time
    runner.close()


def test_an_open_breaker_names_the_last_failure_of_a_single_request():
    runner = _blocking_runner(CircuitBreaker(failure_threshold=1, cooldown_s=30))
    with pytest.raises(ConnectionError):
        runner.call("op", _fail, None, 9)
    assert "last: ConnectionError: request 9 failed" in _last_error(runner)


def test_a_filesystem_is_built_on_a_named_daemon_thread_under_the_deadline():
    from tiered_progcache.stores.runner import FilesystemFactory

    go = threading.Event()
    builders: list[threading.Thread] = []

    class SlowToBuild(MemoryFileSystem):
        """A filesystem whose constructor waits (ftp/sftp connect there); remembers the thread that built it."""

        cachable = False

        def __init__(self, *args, **kwargs):
            builders.append(threading.current_thread())
            assert go.wait(60)
            super().__init__(*args, **kwargs)

    runner = RequestRunner(None, timeout=0.1, breaker=CircuitBreaker(), name="remote C",
                           factory=FilesystemFactory(SlowToBuild, {}))  # fmt: skip
    try:
        with pytest.raises(TimeoutError, match="^connecting to remote C took longer than 0.1 s$"):
            runner.fs
        (builder,) = builders
        assert builder.name == "tiered-progcache-connect" and builder.daemon  # never holds up exit
    finally:
        go.set()


def test_a_runner_has_eight_pool_threads_by_default():
    name = f"pool-{uuid.uuid4().hex[:8]}"
    runner = RequestRunner(MemoryFileSystem(), timeout=5, breaker=CircuitBreaker(failure_threshold=100), name=name)
    gate = threading.Event()
    try:
        got = runner.call_many("batch", lambda n: gate.wait(), None, {n: (n,) for n in range(10)}, timeout=0.2)
        assert len(got.errors) == 10 and all(isinstance(e, TimeoutError) for e in got.errors.values())
        assert len(_pool_threads(name)) == 8
    finally:
        gate.set()
    runner.close()


# -- an object store's class imported where the filesystem is built ---------------------------------------------


@pytest.mark.parametrize("url", ["s3://b", "s3://b/kernels/", "s3a://b/k", "gs://b/k/x", "gcs://b/k/", "s3://b/k?v=1"])
def test_what_a_deferred_factory_declares_is_what_the_class_says_once_imported(url):
    """The scheme's protocol names, an async filesystem, and the path: as the class gives them (s3fs, gcsfs)."""
    import fsspec
    from fsspec.asyn import AsyncFileSystem

    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    factory = DeferredFilesystemFactory.for_url(url, {"anon": True})
    fs_class = fsspec.get_filesystem_class(factory.scheme)
    protocols = (fs_class.protocol,) if isinstance(fs_class.protocol, str) else fs_class.protocol
    assert factory.protocols == frozenset(protocols) and factory.is_async and issubclass(fs_class, AsyncFileSystem)
    assert factory.root == fs_class._strip_protocol(url).rstrip("/") and fs_class.root_marker == ""
    assert dict(factory.storage_options) == {"anon": True}


@pytest.mark.parametrize("url", ["file:///tmp/k", "memory://k", "simplecache::s3://b/k", "s3:/b", "ftp://h/k", "S3://b",
                                 "s3", "gcs"])
def test_only_a_plain_object_store_url_is_deferred(url):
    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    assert DeferredFilesystemFactory.for_url(url, {}) is None


class _BlockingS3(AbstractFileSystem):
    """Registered as s3:// for one test: the path a deferred factory declares, but blocking and one protocol name."""

    protocol = "s3"
    root_marker = ""


def test_a_class_that_is_not_an_async_object_store_of_the_declared_protocols_fails_the_build(monkeypatch):
    import importlib

    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    registry = importlib.import_module("fsspec.registry")  # the module (``fsspec.registry`` is its mapping)
    monkeypatch.setitem(registry._registry, "s3", _BlockingS3)
    factory = DeferredFilesystemFactory.for_url("s3://bucket/kernels", {})
    assert _BlockingS3._strip_protocol("s3://bucket/kernels") == factory.root  # the path agrees; nothing else does
    with pytest.raises(ValueError, match=r"_BlockingS3 is not what this tier took it for"):
        factory.build()


def test_a_store_built_by_a_deferred_factory_needs_its_url():
    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    factory = DeferredFilesystemFactory.for_url("s3://b/k", {"anon": True})
    with pytest.raises(TypeError, match="needs its url"):
        RemoteProgramCache(None, "b/k", factory=factory)


def test_a_deferred_filesystem_takes_the_options_its_url_gives_then_the_storage_options():
    """``?versionId=`` makes s3fs version-aware (its ``_get_kwargs_from_urls``), as an eager build did."""
    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    fs = DeferredFilesystemFactory.for_url("s3://b/k?versionId=1", {"anon": True}).build(fresh=True)
    assert fs.version_aware is True and fs.anon is True
    assert DeferredFilesystemFactory.for_url("s3://b/k", {"anon": True}).build(fresh=True).version_aware is False


def test_a_deferred_filesystem_is_fsspecs_cached_instance_unless_fresh_and_a_trailing_slash_is_the_same_path():
    """As :class:`FilesystemFactory`: a plain build may share fsspec's instance, a fresh one (a forked child) never
    does. gcsfs keeps a trailing ``/`` in its path where s3fs drops it: the same root either way."""
    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    factory = DeferredFilesystemFactory.for_url("gs://b/k/", {"token": "anon"})
    assert factory.root == "b/k"
    assert factory.build() is factory.build() and factory.build(fresh=True) is not factory.build()
    assert DeferredFilesystemFactory.for_url("gs://b/FIX/", {"token": "anon"}).build(fresh=True).protocol  # no "X" lost


def test_a_class_that_disagrees_with_what_was_declared_fails_the_build_and_the_tier_stays_down():
    """A path taken for another (here: the root declared wrong) is never read or written: the build raises, the
    breaker records it, and every request is refused with that reason."""
    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    wrong = DeferredFilesystemFactory("s3", "s3://bucket/kernels", "bucket/other", {"anon": True})
    with pytest.raises(ValueError, match=r"S3FileSystem is not what this tier took it for.*'bucket/kernels'") as raised:
        wrong.build()
    assert str(raised.value).endswith(f"expected {(wrong.protocols, True, 'bucket/other')!r}; build the tier from an "
                                      "fsspec filesystem instead")
    breaker = CircuitBreaker(failure_threshold=1)
    runner = RequestRunner(None, timeout=5, breaker=breaker, name="remote D", factory=wrong)
    with pytest.raises(ValueError, match="not what this tier took it for"):
        runner.call("op", lambda: 1, None)
    assert breaker.state == "open"


_IMPORTS_SEEN = """
import builtins, json, sys, threading
seen = {}
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    top = name.split(".")[0]
    if top in ("fsspec", "s3fs", "botocore", "aiobotocore", "obstore") and top not in sys.modules:
        seen.setdefault(top, threading.current_thread().name.split(" ")[0])
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
import tiered_progcache as tpc
options = json.loads(sys.argv[3])
with tpc.TieredProgramCache(sys.argv[1], remote=sys.argv[2], remote_options=options) as cache:
    constructed = dict(seen)
    cache[b"k" * 32] = b"payload"
    assert cache.flush(60) and cache.get(b"k" * 32, where="shared") == b"payload"
print(json.dumps([constructed, seen]))
"""


def test_a_fresh_process_on_s3_imports_no_client_library_on_the_callers_thread(tmp_path, s3_bucket):
    """The client (obstore, a few ms) is imported where it is built, beside the first compile; the tier's
    construction imports nothing of it, and fsspec, s3fs and botocore (hundreds of ms) are never imported."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORTS_SEEN, str(tmp_path / "node"), s3_bucket.url,
                           json.dumps(s3_bucket.storage_options)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    constructed, seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert constructed == {} or set(constructed.values()) == {"tiered-progcache-connect"}, constructed
    assert seen == {"obstore": "tiered-progcache-connect"}, seen


def test_a_store_refuses_to_be_built_from_nothing_and_keeps_a_root_without_its_trailing_slash():
    with pytest.raises(TypeError) as nothing:
        RemoteProgramCache(None, "b/k")
    assert str(nothing.value) == "RemoteProgramCache needs an fsspec filesystem (or a factory that builds one)"
    from tiered_progcache.stores.runner import DeferredFilesystemFactory

    with pytest.raises(TypeError) as no_url:
        RemoteProgramCache(None, "b/k", factory=DeferredFilesystemFactory.for_url("s3://b/k", {"anon": True}))
    assert str(no_url.value) == "a RemoteProgramCache built by a DeferredFilesystemFactory needs its url"
    fs = MemoryFileSystem(skip_instance_cache=True)
    assert RemoteProgramCache(fs, f"/trailing-{uuid.uuid4().hex[:8]}/kX/", strict=True).root.endswith("/kX")


def test_an_empty_root_on_a_filesystem_with_a_root_marker_puts_entries_at_its_root():
    store = RemoteProgramCache(MemoryFileSystem(skip_instance_cache=True), "", strict=True)
    assert store.path_for("ab" * 32) == "/entries/ab/" + "ab" * 31
