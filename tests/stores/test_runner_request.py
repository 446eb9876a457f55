"""RequestRunner.request: one request written once, as a coroutine, run both ways through the one door."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.runner import BlockingCalls, RequestRunner
from tiered_progcache.testing.slowfs import SlowFileSystem


async def _read(calls, path: str) -> tuple[bytes, str]:
    """One request over fsspec's coroutine names: what it read and the thread it ran on."""
    return await calls._cat_file(path, start=0, end=3), threading.current_thread().name


def test_on_a_blocking_filesystem_the_coroutine_runs_to_its_end_on_a_runner_thread():
    fs = MemoryFileSystem(skip_instance_cache=True)
    fs.pipe_file("/req/a", b"abcdef")
    runner = RequestRunner(fs, timeout=5, breaker=CircuitBreaker(), name="blocking")
    assert isinstance(runner.calls, BlockingCalls)
    data, thread = runner.request("read", _read, runner.calls, "/req/a")
    assert data == b"abc" and thread.startswith("tiered-progcache-remote blocking-")
    assert runner.request_many("batch", _read, {n: (runner.calls, "/req/a") for n in range(2)}).results[1][0] == b"abc"
    assert runner.breaker.state == "closed"
    runner.close()


def test_on_an_async_filesystem_the_same_coroutine_runs_on_its_loop_and_is_cancelled_at_the_deadline():
    fs = SlowFileSystem()
    fs.mkdir("bucket")
    fs.pipe_file("bucket/a", b"abcdef")
    runner = RequestRunner(fs, timeout=5, breaker=CircuitBreaker(failure_threshold=10), name="slow X")
    assert runner.calls is fs
    data, thread = runner.request("read", _read, runner.calls, "bucket/a")
    assert data == b"abc" and not thread.startswith("tiered-progcache-remote")
    fs.delay_s = 3600
    runner.timeout = 0.1
    with pytest.raises(TimeoutError, match=r"^read on slow X took longer than 0.1 s$"):
        runner.request("read", _read, runner.calls, "bucket/a")
    assert fs.in_flight == 0  # cancelled, not abandoned
    fs.delay_s = 0


def test_a_stoppable_request_gets_a_stop_flag_first_both_ways():
    async def flag(stop: threading.Event, n: int) -> tuple[bool, int]:
        return isinstance(stop, threading.Event) and not stop.is_set(), n

    blocking = RequestRunner(MemoryFileSystem(skip_instance_cache=True), timeout=5, breaker=CircuitBreaker(), name="b")
    on_loop = RequestRunner(SlowFileSystem(), timeout=5, breaker=CircuitBreaker(), name="a")
    for runner in (blocking, on_loop):
        assert runner.request("op", flag, 1, stoppable=True) == (True, 1)
        assert runner.request_many("batch", flag, {2: (2,), 3: (3,)}, stoppable=True).results == {2: (True, 2), 3: (True, 3)}
    blocking.close()


def test_a_request_that_suspends_on_a_blocking_filesystem_is_refused_and_counted_as_a_failure():
    async def suspends() -> None:
        await asyncio.sleep(0)

    runner = RequestRunner(MemoryFileSystem(skip_instance_cache=True), timeout=5,
                           breaker=CircuitBreaker(failure_threshold=1), name="b")  # fmt: skip
    with pytest.raises(RuntimeError, match="suspended"):
        runner.request("op", suspends)
    assert runner.breaker.state == "open"
    runner.close()
