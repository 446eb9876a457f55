"""The chain under process faults: fork, interpreter exit, unwritable directories, byte-bounded uploads.

Real processes throughout: ``os.fork()`` children, ``multiprocessing``'s fork context,
and interpreters started with ``subprocess`` that exit without ``close()``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.localdir import entry_name
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.runner import NO_THREADS_AT_EXIT
from tiered_progcache.testing.slowfs import SlowFileSystem

from support import REPO_ROOT, child_pythonpath, wait_child

CHILD_LIMIT_S = 20.0  # a child that takes longer is hung (the bug), not slow


def _fork(body) -> int:
    """Run ``body()`` in a forked child; its return value (an int) is the exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            code = body()
        except BaseException:
            traceback.print_exc()  # shown by pytest with the failure
        finally:
            os._exit(code)
    return wait_child(pid, CHILD_LIMIT_S)


def _file_remote(tmp_path: Path) -> str:
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    return f"file://{tmp_path / 'remote'}"


# -- fork ------------------------------------------------------------------------------------------




def test_forked_child_flush_and_close_return_with_its_write_done(tmp_path):
    """Before: the child inherited a worker that does not exist in it, so flush() never returned."""
    cache = TieredProgramCache(tmp_path / "local", remote=_file_remote(tmp_path), remote_timeout=2)
    cache[b"parent"] = b"p" * 100
    assert cache.flush() is True  # the parent's worker thread exists now: the child inherits no thread

    def child() -> int:
        before = cache.stats()
        cache[b"child"] = b"c" * 100
        if cache.flush() is not True:
            return 1
        if cache.tiers[2].writeback.pending != 0:
            return 2
        remote = (cache.stats() - before)["remote"]
        if remote.writes + remote.timeouts + remote.errors != 1 or remote.dropped:
            return 3  # the child's write was attempted once, neither lost nor queued forever
        cache.close()
        return 0

    assert _fork(child) == 0
    cache.close()


def test_forked_child_writes_land_in_a_file_remote(tmp_path):
    cache = TieredProgramCache(tmp_path / "local", remote=_file_remote(tmp_path), remote_timeout=2)
    cache[b"parent"] = b"p" * 100
    assert cache.flush() is True

    def child() -> int:
        cache[b"child"] = b"c" * 100
        ok = cache.flush()
        cache.close()
        return 0 if ok else 1

    assert _fork(child) == 0
    assert cache.shared_store.read_entry(entry_name(b"child")) == b"c" * 100
    cache.close()


def test_forked_child_starts_with_nothing_pending_and_the_parent_uploads_its_own(tmp_path, cleanup):
    """A write the parent has in flight at fork time is the parent's: the child neither waits on it nor uploads it."""
    gate = threading.Event()
    cleanup.gate(gate)  # a failing assert still lets the held upload go
    fs = SlowFileSystem(write_gate=gate)
    fs.mkdir("bucket")
    cache = cleanup.close(TieredProgramCache(tiers=[RemoteProgramCache(fs, "bucket/k")]))
    cache[b"queued-in-parent"] = b"q" * 10
    assert fs.writes_started.wait(30)  # the parent's upload is under way, held at the gate

    def child() -> int:
        writeback = cache.tiers[0].writeback
        if writeback.pending != 0:
            return 1
        if cache.flush() is not True:  # returns at once: nothing of the child's is pending
            return 2
        cache.close()  # no 30 s wait on the parent's upload
        return 0

    assert _fork(child) == 0
    assert cache.tiers[0].writeback.pending == 1
    gate.set()
    assert cache.flush(30) is True
    assert cache.shared_store.read_entry(entry_name(b"queued-in-parent")) == b"q" * 10
    assert cache.stats()["remote"].dropped == 0
    cache.close()


def _mp_child(cache: TieredProgramCache, conn) -> None:
    cache[b"mp-child"] = b"m" * 50
    conn.send((cache.flush(), cache.shared_store.read_entry(entry_name(b"mp-child")) == b"m" * 50))
    cache.close()


def test_multiprocessing_fork_child_uploads(tmp_path, cleanup):
    cache = cleanup.close(TieredProgramCache(tmp_path / "local", remote=_file_remote(tmp_path), remote_timeout=2))
    cache[b"parent"] = b"p"
    assert cache.flush() is True
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_mp_child, args=(cache, child_end))
    proc.start()
    cleanup.gate(lambda: (proc.kill(), proc.join(CHILD_LIMIT_S)))  # a child that hung is not left behind
    assert parent_end.poll(CHILD_LIMIT_S), "the child hung"
    assert parent_end.recv() == (True, True)
    proc.join(CHILD_LIMIT_S)
    assert proc.exitcode == 0
    assert cache.shared_store.read_entry(entry_name(b"mp-child")) == b"m" * 50
    cache.close()


# -- interpreter exit --------------------------------------------------------------------------------

from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: E402,F401  (fixtures)
from tiered_progcache.chain.exitbudget import TEARDOWN_RESERVE_S  # noqa: E402

#: The exit budget the hanging child is built with (the default, 10 s, is pinned in test_exit_bounds).
EXIT_TIMEOUT_S = 3.0

_WRITE_AND_EXIT = r"""
import json, sys
from tiered_progcache import TieredProgramCache
cache = TieredProgramCache(sys.argv[1], remote=sys.argv[2], remote_options=json.loads(sys.argv[3]))
for i in range(int(sys.argv[4])):
    cache[b"exit-%d" % i] = b"%d" % i * 1000
# no flush(), no close(): the interpreter-exit flush must upload them
"""


def _run_child(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=timeout,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
    )


@pytest.mark.skipif(NO_THREADS_AT_EXIT, reason="this Python starts no thread at exit: "
                    "tests/stores/test_exiting_interpreter.py checks what the dropped uploads say there")
def test_uploads_queued_at_exit_reach_s3(tmp_path, s3_bucket):
    """Before: the exit flush ran after Python shut down the thread pools an s3fs upload needs, so all 20 were lost."""
    out = _run_child(_WRITE_AND_EXIT, str(tmp_path), s3_bucket.url, json.dumps(s3_bucket.storage_options), "20")
    assert out.returncode == 0, out.stderr
    assert "not flushed" not in out.stderr and "shutdown" not in out.stderr, out.stderr
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options)
    assert sorted(e.name for e in remote.iter_entries()) == sorted(entry_name(b"exit-%d" % i) for i in range(20))
    for i in range(20):
        assert remote.read_entry(entry_name(b"exit-%d" % i)) == b"%d" % i * 1000


_HANG_AND_EXIT = r"""
import sys, threading, time
from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.testing.slowfs import SlowFileSystem
fs = SlowFileSystem(write_gate=threading.Event())  # never set: every upload hangs
fs.mkdir("bucket")
cache = TieredProgramCache(tiers=[RemoteProgramCache(fs, "bucket/k", timeout=600)], exit_timeout=float(sys.argv[1]))
for i in range(3):
    cache[b"hang-%d" % i] = b"x"
assert fs.writes_started.wait(60)
print(time.monotonic(), flush=True)  # the moment the script ends; the exit flush starts now
"""


@pytest.mark.parametrize("reporting", [False, True], ids=["plain", "under-stats-run"])
def test_exit_with_a_hanging_remote_takes_at_most_the_exit_flush_bound(tmp_path, monkeypatch, reporting):
    """The docs: pending writes get the exit budget (``exit_timeout``) in all at interpreter exit, then the process exits.

    Under ``stats --run`` the exit report used to flush again for its own 10 s: 20 s in all.
    """
    if reporting:
        monkeypatch.setenv("TIERED_PROGCACHE_STATS_FILE", str(tmp_path / "stats.jsonl"))
    out = _run_child(_HANG_AND_EXIT, str(EXIT_TIMEOUT_S))
    exited = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process of the host
    assert out.returncode == 0, out.stderr
    lag = exited - float(out.stdout.split()[-1])
    # Waited the budget (less the teardown reserve), and no longer than the budget plus a loaded machine's margin.
    assert EXIT_TIMEOUT_S - TEARDOWN_RESERVE_S <= lag <= EXIT_TIMEOUT_S + 1.5, lag
    assert "interpreter exit: 3 background writes not flushed in time" in out.stderr
    if reporting:
        from tiered_progcache.ops.runstats import read_reports

        (report,) = read_reports(tmp_path / "stats.jsonl")
        assert report["tiers"]["remote"]["writes"] == 0 and report["tiers"]["remote"]["dropped"] == 0


# -- the upload queue's byte bound -----------------------------------------------------------------


def test_upload_queue_is_bounded_by_bytes_and_drops_exactly_the_overflow(cleanup):
    """1000 bytes allowed (queued and in flight together); 300-byte writes: 3 fit, the other 7 are dropped."""
    gate = threading.Event()
    cleanup.gate(gate)  # a failing assert still lets the held upload go
    fs = SlowFileSystem(write_gate=gate)
    fs.mkdir("bucket")
    cache = cleanup.close(TieredProgramCache(
        tiers=[RemoteProgramCache(fs, "bucket/k")], max_pending_uploads=100, max_pending_upload_bytes=1000
    ))
    for i in range(10):
        cache[b"big-%d" % i] = b"%d" % i * 300
    assert cache.tiers[0].writeback.pending == 3
    assert cache.stats()["remote"].dropped == 7
    gate.set()
    assert cache.flush(30) is True
    assert sorted(e.name for e in cache.shared_store.iter_entries()) == sorted(entry_name(b"big-%d" % i) for i in range(3))
    # Room again once those are uploaded: a write of exactly the bound fits, one byte more never does.
    gate.clear()
    cache[b"exact"] = b"e" * 1000
    cache[b"over"] = b"o" * 1001
    assert cache.stats()["remote"].dropped == 8
    gate.set()
    assert cache.flush(30) is True
    assert cache.shared_store.read_entry(entry_name(b"exact")) == b"e" * 1000
    cache.close()


def test_replacing_a_queued_write_counts_its_new_size_only(cleanup):
    gate = threading.Event()
    cleanup.gate(gate)  # a failing assert still lets the held upload go
    fs = SlowFileSystem(write_gate=gate)
    fs.mkdir("bucket")
    cache = cleanup.close(
        TieredProgramCache(tiers=[RemoteProgramCache(fs, "bucket/k")], max_pending_upload_bytes=1000)
    )
    cache[b"held"] = b"h" * 400  # in flight, at the gate
    assert fs.writes_started.wait(30)
    cache[b"same"] = b"1" * 500
    cache[b"same"] = b"2" * 600  # replaces the queued 500: 1000 in all, fits
    cache[b"other"] = b"x"  # 1001: dropped
    assert cache.stats()["remote"].dropped == 1
    gate.set()
    assert cache.flush(30) is True
    assert cache.shared_store.read_entry(entry_name(b"same")) == b"2" * 600
    cache.close()


# -- deletes and writes after close ---------------------------------------------------------------------

from tiered_progcache.errors import DeleteFailed  # noqa: E402
from tiered_progcache.testing.servers import private_moto_server  # noqa: E402,F401  (fixture)


def test_delete_during_an_outage_raises_instead_of_letting_the_entry_come_back(private_moto_server, tmp_path):
    """The remote's failure is raised (``DeleteFailed``), so no later process reads k back from the remote unawares."""
    bucket = private_moto_server.new_bucket()
    cache = TieredProgramCache(
        tmp_path, remote=bucket.url, remote_options=bucket.storage_options, remote_timeout=2
    )
    cache[b"k"] = b"v" * 100
    assert cache.flush(30) is True
    private_moto_server.stop()
    with pytest.raises(DeleteFailed, match="remote") as raised:
        del cache[b"k"]
    assert raised.value.tiers == ("remote",)
    # The tiers that could delete did: this process no longer serves k from memory or disk.
    assert cache.tier("memory").lookup(b"k") is None and cache.tier("local").lookup(b"k") is None
    assert cache.stats()["remote"].errors + cache.stats()["remote"].timeouts + cache.stats()["remote"].skipped == 1
    cache.close(timeout=1)


def test_delete_cancels_a_queued_upload(tmp_path, cleanup):
    """The upload of k queued behind a stuck one must not land after ``del cache[k]``."""
    gate = threading.Event()
    cleanup.gate(gate)  # a failing assert still lets the held upload go
    fs = SlowFileSystem(write_gate=gate)
    fs.mkdir("bucket")
    cache = cleanup.close(TieredProgramCache(tiers=[RemoteProgramCache(fs, "bucket/k")]))
    cache[b"first"] = b"1"
    assert fs.writes_started.wait(30)  # "first" is under way, held at the gate
    cache[b"k"] = b"queued"
    del cache[b"k"]
    gate.set()
    assert cache.flush(30) is True
    assert [e.name for e in cache.shared_store.iter_entries()] == [entry_name(b"first")]
    assert fs.requests["put"] == 1
    cache.close()


def test_a_write_after_close_is_dropped_counted_and_logged_as_closed(tmp_path, caplog):
    cache = TieredProgramCache(tmp_path / "local", remote=_file_remote(tmp_path))
    cache.close()
    with caplog.at_level("WARNING", logger="tiered_progcache"):
        cache[b"late"] = b"x"
    assert cache.stats()["remote"].dropped == 1
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        "tier remote: background write dropped (closed)"
    ]


# -- an unusable local directory --------------------------------------------------------------------

from cuda.core import ProgramOptions  # noqa: E402

import tiered_progcache  # noqa: E402
from tiered_progcache.samples import matmul_source  # noqa: E402


def _blocked_dir(tmp_path: Path) -> Path:
    """A directory path that cannot be created, even by root: its parent is a regular file."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    return blocker / "cache"


@pytest.mark.parametrize("how", ["path", "env", "default"])
def test_an_unusable_local_dir_leaves_the_local_tier_out_with_a_warning(tmp_path, monkeypatch, caplog, how):
    """Before: NotADirectoryError out of the constructor, so compile() failed for want of a cache directory."""
    blocked = _blocked_dir(tmp_path)
    remote = _file_remote(tmp_path)
    with caplog.at_level("WARNING", logger="tiered_progcache"):
        if how == "path":
            cache = TieredProgramCache(blocked, remote=remote)
        elif how == "env":
            monkeypatch.setenv("TIERED_PROGCACHE_DIR", str(blocked))
            monkeypatch.setenv("TIERED_PROGCACHE_REMOTE", remote)
            cache = TieredProgramCache.from_env()
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # cuda-core's default dir is under it
            cache = TieredProgramCache(remote=remote)
    assert [t.name for t in cache.tiers] == ["memory", "remote"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(blocked) in warnings[0] and "local" in warnings[0], warnings
    cache[b"k"] = b"v"
    assert cache.flush(30) is True
    assert cache.get(b"k") == b"v" and cache.shared_store.read_entry(entry_name(b"k")) == b"v"
    cache.close()


def test_compile_works_with_an_unusable_local_dir(tmp_path):
    options = ProgramOptions(std="c++17", arch="sm_90")
    with TieredProgramCache(_blocked_dir(tmp_path)) as cache:
        first = tiered_progcache.compile(matmul_source(16), "c++", options, cache=cache)
        again = tiered_progcache.compile(matmul_source(16), "c++", options, cache=cache)
        assert bytes(first.code)[:4] == b"\x7fELF" and bytes(again.code) == bytes(first.code)
        assert cache.stats()["memory"].hits == 1
