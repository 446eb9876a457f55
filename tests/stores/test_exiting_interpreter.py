"""An exiting interpreter that refuses a request its thread is not the store's failure.

Python 3.12.0 to 3.12.2 start no thread once the main thread has ended, so a process that queued
uploads and ended before its store's client was built had each upload refused at the exit flush:
the probe was reported as "unreachable", the breaker opened, and the node's down memo kept the store
off for every process of the next 30 s. Now such a refusal raises ``InterpreterExiting``, which the
breaker and the down memo do not count, and the dropped write's line says what happened and what to do.
Where the refusal is real (those Pythons) the exit test below runs it; elsewhere the refusal is made by
the tests, with CPython's own messages.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import types

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tiered_progcache import TieredProgramCache
from tiered_progcache.chain.downmemo import DOWN_MEMO_DIR
from tiered_progcache.errors import InterpreterExiting
from tiered_progcache.stores import remote, runner
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.runner import NO_THREADS_AT_EXIT, RequestRunner, exiting_refusal
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.redis_server import RedisServer
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401  (fixtures)

from support import REPO_ROOT, child_pythonpath

NO_THREAD = "can't create new thread at interpreter shutdown"  # CPython 3.12's words
NO_FUTURES = "cannot schedule new futures after interpreter shutdown"  # concurrent.futures' words
ADVICE = ("Python 3.12.0 to 3.12.2 start no thread once the main thread has ended; call flush() or close() before "
          "the process ends, or use Python 3.12.3 or later")


def test_only_the_interpreters_refusals_at_exit_are_named_as_such(monkeypatch):
    cause = RuntimeError(NO_THREAD)
    monkeypatch.setattr(runner, "NO_THREADS_AT_EXIT", False)  # 3.10, 3.11, 3.12.3 and later: no advice
    named = exiting_refusal(cause, "create on s3://b/k")
    assert isinstance(named, InterpreterExiting) and isinstance(named, RuntimeError) and named.__cause__ is cause
    assert str(named) == f"create on s3://b/k not made, the interpreter is exiting ({NO_THREAD})"
    monkeypatch.setattr(runner, "NO_THREADS_AT_EXIT", True)  # 3.12.0 to 3.12.2: what to do instead
    assert str(exiting_refusal(cause, "create on s3://b/k")) == (
        f"create on s3://b/k not made, the interpreter is exiting ({NO_THREAD}): {ADVICE}")
    futures = exiting_refusal(RuntimeError(NO_FUTURES), "read")
    assert str(futures).startswith(f"read not made, the interpreter is exiting ({NO_FUTURES})")
    assert exiting_refusal(named, "other") is named
    for other in (RuntimeError("cannot schedule new futures after shutdown"),  # a pool someone shut down
                  RuntimeError("boom"), OSError("interpreter shutdown"), ConnectionError(NO_THREAD)):
        assert exiting_refusal(other, "read") is None
    assert NO_THREADS_AT_EXIT is (sys.version_info[:3] in {(3, 12, 0), (3, 12, 1), (3, 12, 2)})


def test_a_request_the_exiting_interpreter_refused_is_not_counted_by_the_breaker():
    breaker = CircuitBreaker(failure_threshold=2)
    calls = RequestRunner(MemoryFileSystem(), timeout=5, breaker=breaker, name="test remote")

    def refused(message: str) -> None:
        raise RuntimeError(message)

    for _ in range(3):
        with pytest.raises(InterpreterExiting, match=r"^op on test remote not made, the interpreter is exiting"):
            calls.call("op", refused, None, NO_THREAD)
    outcome = calls.call_many("batch", refused, None, {1: (NO_FUTURES,), 2: (NO_THREAD,)})
    assert sorted(outcome.errors) == [1, 2] and all(isinstance(e, InterpreterExiting) for e in outcome.errors.values())
    assert str(outcome.errors[1]).startswith(f"batch on test remote not made, the interpreter is exiting ({NO_FUTURES})")
    assert (breaker.state, breaker.consecutive_failures) == ("closed", 0)
    with pytest.raises(RuntimeError, match="^boom$"):
        calls.call("op", refused, None, "boom")  # any other error is the store's
    assert breaker.consecutive_failures == 1
    calls.close()


def test_a_batch_whose_filesystem_cannot_be_built_at_exit_is_refused_and_not_counted():
    from tiered_progcache.stores.runner import FilesystemFactory

    class NoLoopThread(MemoryFileSystem):
        cachable = False

        def __init__(self, **kwargs: object) -> None:
            raise RuntimeError(NO_THREAD)  # what fsspec's loop thread raises when the filesystem is built at exit

    breaker = CircuitBreaker(failure_threshold=1)
    calls = RequestRunner(None, timeout=5, breaker=breaker, name="remote L", factory=FilesystemFactory(NoLoopThread, {}))
    outcome = calls.call_many("batch", lambda n: n, None, {1: (1,), 2: (2,)})
    assert all(isinstance(e, InterpreterExiting) for e in outcome.errors.values()) and not outcome.results
    assert str(outcome.errors[2]).startswith(f"batch on remote L not made, the interpreter is exiting ({NO_THREAD})")
    assert breaker.state == "closed"


class _Refused(threading.Thread):
    def start(self) -> None:
        raise RuntimeError(NO_THREAD)


def _no_threads_in_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner module's ``threading``, whose threads do not start (the rest of the process's do)."""
    monkeypatch.setattr(runner, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": _Refused}))


def test_a_batch_that_gets_no_thread_is_refused_and_not_counted(monkeypatch):
    breaker = CircuitBreaker(failure_threshold=1)
    calls = RequestRunner(MemoryFileSystem(), timeout=5, breaker=breaker, name="test remote")
    _no_threads_in_the_runner(monkeypatch)
    outcome = calls.call_many("batch", lambda n: n, None, {1: (1,), 2: (2,)})
    assert not outcome.results and all(isinstance(e, InterpreterExiting) for e in outcome.errors.values())
    assert str(outcome.errors[1]).startswith(f"batch on test remote not made, the interpreter is exiting ({NO_THREAD})")
    assert breaker.state == "closed"


def test_a_thread_that_cannot_start_leaves_the_pool_as_it_was_and_its_job_never_runs(monkeypatch):
    pool = runner._DaemonThreads(1, name="exit test")
    ran: list[str] = []
    _no_threads_in_the_runner(monkeypatch)
    with pytest.raises(RuntimeError, match=NO_THREAD):
        pool.submit(ran.append, "refused")
    monkeypatch.undo()
    assert pool._threads == 0  # not counted: the next submit starts the thread
    assert pool.submit(ran.append, "next").result(30) is None
    pool.close()
    assert ran == ["next"]  # the refused job was cancelled, not run late


def _refusing_probe(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    async def is_dir(self: object, path: str) -> bool:
        raise RuntimeError(message)

    monkeypatch.setattr(remote._Objects, "is_dir", is_dir)


def test_a_probe_the_exiting_interpreter_refused_opens_no_breaker_and_leaves_no_down_memo(tmp_path, monkeypatch,
                                                                                            caplog):
    (tmp_path / "share").mkdir()
    url = f"file://{tmp_path / 'share'}"
    _refusing_probe(monkeypatch, NO_THREAD)
    caplog.set_level(logging.INFO, logger="tiered_progcache.stores.remote")
    with TieredProgramCache(tmp_path / "node", remote=url) as cache:
        assert cache.shared_store.wait_ready(60)
        assert cache.shared_store.breaker.state == "closed"
    assert not (tmp_path / "node" / DOWN_MEMO_DIR).exists() or not any((tmp_path / "node" / DOWN_MEMO_DIR).iterdir())
    [line] = [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.stores.remote"]
    assert line.startswith(f"remote cache {url}: probe not made: probe on {url} not made, the interpreter is exiting "
                           f"({NO_THREAD})")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_probe_that_fails_otherwise_is_remembered_down(tmp_path, monkeypatch):
    """The counterpart: the same probe failing with another RuntimeError opens the breaker and writes the memo."""
    (tmp_path / "share").mkdir()
    _refusing_probe(monkeypatch, "boom")
    with TieredProgramCache(tmp_path / "node", remote=f"file://{tmp_path / 'share'}") as cache:
        assert cache.shared_store.wait_ready(60)
        assert cache.shared_store.breaker.state == "open"
    assert len(list((tmp_path / "node" / DOWN_MEMO_DIR).iterdir())) == 1


def test_a_redis_probe_the_exiting_interpreter_refused_opens_no_breaker(tmp_path, monkeypatch, caplog):
    pytest.importorskip("redis")
    from tiered_progcache.stores.redis_store import RedisProgramCache

    def refused(self: object) -> None:
        raise RuntimeError(NO_THREAD)  # the spare PING's thread, refused

    monkeypatch.setattr(RedisProgramCache, "_ping_on_two_connections", refused)
    caplog.set_level(logging.INFO, logger="tiered_progcache.stores.redis_store")
    with RedisServer() as server, TieredProgramCache(tmp_path / "node", remote=server.url) as cache:
        assert cache.shared_store.wait_ready(60)
        assert cache.shared_store.breaker.state == "closed"
    assert not (tmp_path / "node" / DOWN_MEMO_DIR).exists() or not any((tmp_path / "node" / DOWN_MEMO_DIR).iterdir())
    [line] = [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.stores.redis_store"]
    assert line.startswith("redis cache ") and ": probe not made: probe on " in line and f"({NO_THREAD})" in line


_WRITE_AND_EXIT = r"""
import json, sys
from tiered_progcache import TieredProgramCache
cache = TieredProgramCache(sys.argv[1], remote=sys.argv[2], remote_options=json.loads(sys.argv[3]))
for i in range(int(sys.argv[4])):
    cache[b"exit-%d" % i] = b"%d" % i * 1000
if sys.argv[5] == "flush":
    assert cache.flush(60)
"""


@pytest.mark.skipif(not NO_THREADS_AT_EXIT, reason="this Python starts threads in the exit flush "
                    "(tests/chain/test_chain_faults.py uploads at exit there)")
def test_on_a_python_that_starts_no_thread_at_exit_the_dropped_uploads_say_why_and_a_flush_keeps_them(
        tmp_path, s3_bucket):
    args = [str(tmp_path / "node"), s3_bucket.url, json.dumps(s3_bucket.storage_options), "5"]
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    out = subprocess.run([sys.executable, "-c", _WRITE_AND_EXIT, *args, "exit"], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("tier remote failed a write (dropped): InterpreterExiting(") == 1, out.stderr  # 5 dropped
    assert ADVICE in out.stderr
    assert "unreachable" not in out.stderr and not (tmp_path / "node" / DOWN_MEMO_DIR).exists(), out.stderr
    out = subprocess.run([sys.executable, "-c", _WRITE_AND_EXIT, *args, "flush"], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=120, env=env)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    names = sorted(e.name for e in remote.RemoteProgramCache.from_url(
        s3_bucket.url, storage_options=s3_bucket.storage_options).iter_entries())
    assert names == sorted(entry_name(b"exit-%d" % i) for i in range(5))
