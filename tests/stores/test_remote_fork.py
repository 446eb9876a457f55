"""A forked child reads and writes through the parent's remote tier (moto S3 and file://) with the right bytes.

Before: the child inherited the parent's runner threads (gone in the child) and s3fs's
event loop and sessions (not fork-safe), so reads timed out or raised. The child has an
alarm so a hang fails the test with SIGALRM, with the signal's default action (pytest-timeout's
handler, which the child inherits, runs only when Python code runs), and the parent kills a child
that is still running after a minute (support.wait_child): one child hung past the suite's 300 s
bound, stuck where no alarm it set could reach.
"""

from __future__ import annotations

import os
import signal

import pytest

from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from support import wait_child

PARENT, CHILD = entry_name(b"from the parent"), entry_name(b"from the child")


def _alarm_kills_me(seconds: int) -> None:
    """In a forked child: be killed by SIGALRM in ``seconds`` whatever it is doing (the default action)."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(seconds)


def _exercise_in_a_forked_child(remote: RemoteProgramCache) -> None:
    remote.write_entry(PARENT, b"parent bytes")
    assert remote.read_entry(PARENT) == b"parent bytes"  # threads, loop and sessions are live in the parent
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            _alarm_kills_me(60)
            ok = remote.read_entry(PARENT) == b"parent bytes"
            remote.write_entry(CHILD, b"child bytes")
            ok = ok and remote.read_entry(CHILD) == b"child bytes"
            ok = ok and {e.name for e in remote.iter_entries()} == {PARENT, CHILD}
            code = 0 if ok and remote.breaker.state == "closed" else 2
        finally:
            os._exit(code)
    assert wait_child(pid) == 0
    assert remote.read_entry(CHILD) == b"child bytes"  # and the parent still works, and sees it
    remote.close()


def test_forked_child_uses_an_s3_remote(s3_bucket):
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True)
    _exercise_in_a_forked_child(remote)


def test_forked_child_uses_a_file_remote(tmp_path):
    remote = RemoteProgramCache.from_url(tmp_path.as_uri(), strict=True)
    _exercise_in_a_forked_child(remote)


def test_forked_child_rebuilds_the_s3_filesystem_outside_fsspecs_cache(s3_bucket):
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True)
    parent_fs = remote.fs
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _alarm_kills_me(60)
            child_fs = remote.fs
            code = 0 if child_fs is not parent_fs and child_fs is not type(child_fs)(**s3_bucket.storage_options) else 3
        finally:
            os._exit(code)
    assert wait_child(pid) == 0
    assert remote.fs is parent_fs


if not hasattr(os, "fork"):
    pytestmark = pytest.mark.skip("no os.fork here")
