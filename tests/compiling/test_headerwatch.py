"""Header watches: inotify tells a warm header_digest() call that nothing changed, and every change is seen.

Each edit below must give a new digest on the very next call, with the call before it
answered on inotify's word (no stat). Counts come from ``headermemo.validation_counts()``
and the watcher's own ``counts()``; no test waits on time.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from cuda.core import ProgramOptions

from tiered_progcache.compiling import headermemo, headerwatch
from tiered_progcache.compiling.headerscan import header_digest
from tiered_progcache.compiling.headerwatch import HeaderWatcher, replace_watcher
from tiered_progcache.stores.fsutil import MountTable

from header_support import OLD, SRC, fresh_header_memo  # noqa: F401  (autouse)
from header_support import write_header as _write
from support import child_pythonpath, options as _opts

pytest.importorskip("inotify_simple")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux-only")

ARCH = "sm_90"


def _edit_in_place(path: Path, text: str) -> None:
    """Same size, same mtime afterwards: only the content and the ctime change."""
    st = os.stat(path)
    assert len(text.encode()) == st.st_size
    with open(path, "r+b") as fh:
        fh.write(text.encode())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def watching():
    """A watcher of this test's own, installed as the process's."""
    watcher = HeaderWatcher()
    previous = replace_watcher(watcher)
    yield watcher
    replace_watcher(previous)
    watcher.close()


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """top/inc/ with a.h -> sub/b.h -> c.h (quoted, relative) and a bystander; settled mtimes."""
    inc = tmp_path / "top" / "inc"
    _write(inc / "a.h", '#pragma once\n#include "sub/b.h"\n#define A_VAL (B_VAL + 1)\n')
    _write(inc / "sub" / "b.h", '#pragma once\n#include "c.h"\n#define B_VAL (C_VAL * 2)\n')
    _write(inc / "sub" / "c.h", "#pragma once\n#define C_VAL 3\n")
    _write(inc / "unrelated.h", "#define NOT_USED 1\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return inc


def _watched(src: str, opts: ProgramOptions) -> bytes:
    """Scan, validate once by stat (which sets up the watch), then show a call answered by the watch alone."""
    digest = header_digest(src, opts)
    assert header_digest(src, opts) == digest
    before = headermemo.validation_counts()
    assert header_digest(src, opts) == digest
    after = headermemo.validation_counts()
    assert (after.by_watch - before.by_watch, after.by_stat - before.by_stat,
            after.paths_statted - before.paths_statted) == (1, 0, 0)
    return digest


def _next_call(src: str, opts: ProgramOptions) -> tuple[bytes, int]:
    """The digest of the next call, and how many calls inotify answered for it (0: it looked again)."""
    before = headermemo.validation_counts().by_watch
    digest = header_digest(src, opts)
    return digest, headermemo.validation_counts().by_watch - before


def _memo() -> headermemo.ScanResult:
    (result,) = headermemo._scan_memo.values()
    return result


# -- every kind of edit, seen on the very next call ---------------------------------------------------


def test_an_in_place_edit_keeping_size_and_mtime_is_seen_on_the_next_call(tree, watching):
    before = _watched(SRC, _opts(tree))
    _edit_in_place(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 4\n")
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0
    assert watching.counts().invalidations == 1


def test_a_header_replaced_by_rename_is_seen(tree, watching):
    before = _watched(SRC, _opts(tree))
    _write(tree / "sub" / "c.h.new", "#pragma once\n#define C_VAL 5\n")
    os.replace(tree / "sub" / "c.h.new", tree / "sub" / "c.h")
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0


def test_a_deleted_header_is_seen(tree, watching):
    before = _watched(SRC, _opts(tree))
    os.unlink(tree / "sub" / "c.h")
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0


def test_a_header_created_earlier_on_the_include_path_is_seen(tree, tmp_path, watching):
    early = tmp_path / "early"
    early.mkdir()
    before = _watched(SRC, _opts(early, tree))
    _write(early / "a.h", "#define A_VAL 99\n")  # now shadows inc/a.h
    digest, by_watch = _next_call(SRC, _opts(early, tree))
    assert digest != before and by_watch == 0


def test_retargeting_a_symlinked_include_directory_is_seen(tmp_path, monkeypatch, watching):
    monkeypatch.chdir(tmp_path)
    for name, val in (("one", 1), ("two", 2)):
        _write(tmp_path / name / "a.h", f"#define A_VAL {val}\n")
    link = tmp_path / "inc"
    link.symlink_to(tmp_path / "one")
    before = _watched(SRC, _opts(link))
    staged = tmp_path / "inc.new"
    staged.symlink_to(tmp_path / "two")
    os.replace(staged, link)  # ln -sfn: one rename, the include directory now elsewhere
    digest, by_watch = _next_call(SRC, _opts(link))
    assert digest != before and by_watch == 0


def test_renaming_an_ancestor_directory_is_seen(tree, watching):
    before = _watched(SRC, _opts(tree))
    top = tree.parent
    os.rename(top, top.with_name("top-moved"))
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0  # the include directory is gone: a.h is missing now


def test_a_write_through_another_hard_link_is_seen(tree, tmp_path, watching):
    """The directory we watch sees nothing of it; the inode watch on the header does."""
    before = _watched(SRC, _opts(tree))
    other = tmp_path / "elsewhere" / "alias.h"
    other.parent.mkdir()
    os.link(tree / "sub" / "c.h", other)
    events = watching.counts().events
    _edit_in_place(other, "#pragma once\n#define C_VAL 6\n")
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0
    assert watching.counts().events > events


def test_a_symlinked_header_edited_at_its_target_is_seen(tree, tmp_path, watching):
    target = _write(tmp_path / "vendor" / "real_c.h", "#pragma once\n#define C_VAL 3\n")
    os.unlink(tree / "sub" / "c.h")
    (tree / "sub" / "c.h").symlink_to(target)
    before = _watched(SRC, _opts(tree))
    _edit_in_place(target, "#pragma once\n#define C_VAL 7\n")
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0


def test_an_edit_by_another_process_is_seen_on_the_next_call(tree, watching):
    """The kernel queues the event inside the other process's write(2): once it has exited, our
    next non-blocking read has the event (no wait, no sleep)."""
    before = _watched(SRC, _opts(tree))
    edit = textwrap.dedent(
        """
        import os, sys
        path = sys.argv[1]
        st = os.stat(path)
        with open(path, "r+b") as fh:
            fh.write(b"#pragma once\\n#define C_VAL 8\\n")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        """
    )
    subprocess.run([sys.executable, "-c", edit, str(tree / "sub" / "c.h")], check=True)
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0


def test_a_change_to_an_unrelated_name_keeps_the_watch(tree, watching):
    """Events name what changed: a file the scan never looked up does not cost a re-stat."""
    before = _watched(SRC, _opts(tree))
    _write(tree / "unrelated.h", "#define NOT_USED 2\n")
    _write(tree / "brand_new.h", "#define NEW 1\n")
    counts = headermemo.validation_counts()
    assert header_digest(SRC, _opts(tree)) == before
    after = headermemo.validation_counts()
    assert (after.by_watch - counts.by_watch, after.by_stat - counts.by_stat) == (1, 0)
    assert watching.counts().invalidations == 0


def test_a_touch_without_change_is_looked_at_once_then_watched_again(tree, watching):
    before = _watched(SRC, _opts(tree))
    hashed = headermemo.files_hashed()
    os.utime(tree / "sub" / "b.h", (OLD + 60, OLD + 60))
    assert _next_call(SRC, _opts(tree)) == (before, 0)
    assert headermemo.files_hashed() - hashed == 1  # b.h read again, found the same
    _watched(SRC, _opts(tree))


def test_threads_calling_after_an_edit_returned_never_get_the_old_digest(tree, watching):
    """The descriptor is read under a lock: a call cannot see "no event pending" while another
    thread holds events it has read but not applied yet."""
    before = _watched(SRC, _opts(tree))
    edited = threading.Event()
    stale: list[bytes] = []
    calls_after = [0] * 4
    ready = [threading.Event() for _ in calls_after]
    finished = [threading.Event() for _ in calls_after]

    def worker(i: int) -> None:
        calls = 0
        while calls_after[i] < 50:
            after_edit = edited.is_set()
            digest = header_digest(SRC, _opts(tree))
            calls += 1
            if calls == 50:
                ready[i].set()
            if after_edit:
                calls_after[i] += 1
                if digest == before:
                    stale.append(digest)
        finished[i].set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls_after))]
    for t in threads:
        t.start()
    for r in ready:
        assert r.wait(60)
    _edit_in_place(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 9\n")
    edited.set()
    for t, f in zip(threads, finished):
        assert f.wait(60)
        t.join()
    assert stale == [] and calls_after == [50] * 4


# -- when the events cannot be trusted ----------------------------------------------------------------


def test_a_queue_overflow_falls_back_to_stat_and_misses_no_edit(tree, watching):
    """Fill the kernel's queue (alternating names, so no event merges), then edit: the edit's event is
    lost; IN_Q_OVERFLOW makes the next call look by stat, which sees it (ctime)."""
    before = _watched(SRC, _opts(tree))
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    flood = [_write(tree / "flood_a.tmp", "a"), _write(tree / "flood_b.tmp", "b")]
    for _ in range(limit // 2 + 1):
        os.utime(flood[0])
        os.utime(flood[1])
    _edit_in_place(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 1\n")
    stats_before = headermemo.validation_counts().by_stat
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest != before and by_watch == 0
    assert watching.counts().overflows == 1
    assert headermemo.validation_counts().by_stat - stats_before == 1


def test_the_overflow_handler_invalidates_every_subscription(tree, watching):
    before = _watched(SRC, _opts(tree))
    watching.handle_overflow()
    stats_before = headermemo.validation_counts().by_stat
    assert _next_call(SRC, _opts(tree)) == (before, 0)
    assert headermemo.validation_counts().by_stat - stats_before == 1


def test_headers_on_an_untrusted_filesystem_are_re_statted_on_every_call(tree, tmp_path):
    """A mount table in which inc/sub is NFS: what lives there is stat'ed every call, the rest watched."""
    table = tmp_path / "mountinfo"
    table.write_text(f"21 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                     f"22 21 0:50 / {str(tree / 'sub').replace(' ', chr(92) + '040')} rw - nfs4 host:/export rw\n")
    watcher = HeaderWatcher(mountinfo_path=str(table))
    previous = replace_watcher(watcher)
    try:
        assert watcher.fs_type(str(tree / "sub" / "c.h")) == "nfs4" and watcher.fs_type(str(tree)) == "ext4"
        digest = header_digest(SRC, _opts(tree))
        header_digest(SRC, _opts(tree))
        sub = _memo().watch
        on_nfs = sorted(p for p, _ in _memo().checks if p.startswith(str(tree / "sub") + os.sep))
        assert sorted(p for p, _ in sub.stat_checks) == on_nfs and on_nfs
        before = headermemo.validation_counts()
        assert header_digest(SRC, _opts(tree)) == digest
        after = headermemo.validation_counts()
        assert (after.by_watch - before.by_watch, after.paths_statted - before.paths_statted) == (1, len(on_nfs))
        _edit_in_place(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 2\n")  # no event is watched there
        assert header_digest(SRC, _opts(tree)) != digest
    finally:
        replace_watcher(previous)
        watcher.close()


def test_a_spent_watch_budget_re_stats_what_it_could_not_watch(tree):
    watcher = HeaderWatcher(max_watches=3)
    previous = replace_watcher(watcher)
    try:
        digest = header_digest(SRC, _opts(tree))
        header_digest(SRC, _opts(tree))
        counts = watcher.counts()
        assert counts.watches == 3 and counts.refused > 0
        result = _memo()
        assert result.watch is not None and len(result.watch.stat_checks) == len(result.checks)
        before = headermemo.validation_counts()
        assert header_digest(SRC, _opts(tree)) == digest
        assert headermemo.validation_counts().paths_statted - before.paths_statted == len(result.checks)
        _edit_in_place(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 4\n")
        assert header_digest(SRC, _opts(tree)) != digest
    finally:
        replace_watcher(previous)
        watcher.close()


def test_without_a_watcher_every_call_is_a_stat_validation(tree):
    previous = replace_watcher(None)
    try:
        digest = header_digest(SRC, _opts(tree))
        before = headermemo.validation_counts()
        for _ in range(3):
            assert header_digest(SRC, _opts(tree)) == digest
        after = headermemo.validation_counts()
        assert (after.by_stat - before.by_stat, after.by_watch - before.by_watch) == (3, 0)
        _edit_in_place(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 5\n")
        assert header_digest(SRC, _opts(tree)) != digest
    finally:
        replace_watcher(previous)


def test_without_inotify_simple_digests_work_by_stat(tree):
    """A real process in which the package cannot be imported (as on a host without it)."""
    child = textwrap.dedent(
        """
        import sys
        sys.modules["inotify_simple"] = None  # import fails as if not installed
        from cuda.core import ProgramOptions
        from tiered_progcache.compiling import headermemo, headerscan, headerwatch
        opts = ProgramOptions(arch="sm_90", include_path=[sys.argv[1]])
        src = '#include <a.h>\\n'
        digests = {headerscan.header_digest(src, opts) for _ in range(3)}
        counts = headermemo.validation_counts()
        print(headerwatch.watcher() is None, len(digests), counts.by_stat, counts.by_watch)
        """
    )
    out = subprocess.run([sys.executable, "-c", child, str(tree)], check=True, capture_output=True, text=True,
                         cwd=tree, env={**os.environ, "PYTHONPATH": child_pythonpath()}).stdout.split()
    assert out == ["True", "1", "2", "0"]


def test_a_forked_child_never_reads_the_parents_events(tree, watching):
    """The child shares the inotify queue at fork: reading it would steal the parent's events. The child
    drops the watcher (its memo goes back to stat); the parent still gets the event of the child's edit."""
    before = _watched(SRC, _opts(tree))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.close(read_end)
            counts = headermemo.validation_counts()
            _edit_in_place(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 6\n")
            digest = header_digest(SRC, _opts(tree))
            again = header_digest(SRC, _opts(tree))
            third = header_digest(SRC, _opts(tree))
            after = headermemo.validation_counts()
            os.write(write_end, json.dumps([digest.hex(), again == digest == third, after.by_stat - counts.by_stat,
                                            after.by_watch - counts.by_watch]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        child = json.loads(fh.read())
    os.waitpid(pid, 0)
    # the child: first call looked by stat (its memo's watch was the parent's), second watched it anew
    assert child[0] != before.hex() and child[1] is True and child[2:] == [2, 1]
    events = watching.counts().events
    digest, by_watch = _next_call(SRC, _opts(tree))
    assert digest.hex() == child[0] and by_watch == 0
    assert watching.counts().events > events  # the parent was told by its own queue


def test_a_mount_over_an_include_directory_is_seen(tree, watching):
    """A mount raises no inotify event; the mount table's POLLPRI does."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8)")
    before = _watched(SRC, _opts(tree))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "none", str(tree / "sub")], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount here: {mounted.stderr.decode().strip()}")
    try:
        digest, by_watch = _next_call(SRC, _opts(tree))  # sub/ is an empty tmpfs now: b.h is gone
        assert digest != before and by_watch == 0
    finally:
        subprocess.run(["umount", str(tree / "sub")], check=True)


def test_mmap_writes_raise_no_event_until_the_mapping_closes_the_documented_limit(tmp_path, watching):
    """Backs the docstring: a write through a shared mapping raises no inotify event (the kernel still moves
    mtime/ctime at the write fault, so a stat would see it); IN_CLOSE_WRITE comes when the last reference
    to the file opened for writing, here the mapping, goes."""
    path = _write(tmp_path / "mapped.h", "#define M 1\n")
    sub = watching.subscribe([(str(path), headermemo.signature(str(path)))], [],
                             signature=headermemo.signature, signature_of_stat=headermemo.signature_of_stat)
    assert sub.valid
    st = os.stat(path)
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, st.st_size)
    os.close(fd)  # the mapping keeps the file open for writing
    events = watching.counts().events
    mapping[len("#define M ")] = ord("2")
    assert sub.current() and watching.counts().events == events  # written, and nothing said
    assert os.stat(path).st_mtime_ns != st.st_mtime_ns
    mapping.close()
    assert not sub.current() and watching.counts().events == events + 2  # to the directory and to the inode watch


def test_the_mount_table_is_read_as_the_kernel_writes_it(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text(
        "21 1 254:0 / / rw - ext4 /dev/vda rw\n"
        "30 21 0:40 / /data/my\\040disk rw shared:1 - xfs /dev/sdb rw\n"
        "31 21 0:41 / /data/my\\040disk rw - fuse.sshfs host: rw\n"  # mounted over: the last one wins
        "garbage line\n"
    )
    watcher = HeaderWatcher(mountinfo_path=str(table))
    try:
        types = watcher._mounts.types
        assert types == {"/": "ext4", "/data/my disk": "fuse.sshfs"}
        assert watcher._mounts.fs_type("/data/my disk/inc/a.h") == "fuse.sshfs"
        assert watcher._mounts.fs_type("/data/my diskette") == "ext4"
    finally:
        watcher.close()


def test_bad_arguments_name_the_problem():
    with pytest.raises(TypeError, match="max_watches"):
        HeaderWatcher(max_watches="10")
    with pytest.raises(ValueError, match="max_watches"):
        HeaderWatcher(max_watches=0)


def test_the_default_budget_is_the_documented_8192_watches(tmp_path):
    assert headerwatch.DEFAULT_MAX_WATCHES == 8192
    many = tmp_path / "many"
    many.mkdir()
    checks = []
    for i in range(8200):
        path = many / f"h{i}.h"
        path.write_bytes(b"")
        checks.append((str(path), headermemo.signature(str(path))))
    watcher = HeaderWatcher()
    try:
        sub = watcher.subscribe(checks, [], signature=headermemo.signature, signature_of_stat=headermemo.signature_of_stat)
        assert sub.valid and watcher.counts().watches == 8192
        assert 0 < len(sub.stat_checks) < len(checks)  # the rest re-statted by the caller
    finally:
        watcher.close()


def test_the_mount_memo_keeps_the_most_recently_used_paths_within_its_bound(monkeypatch):
    from tiered_progcache.stores import fsutil

    monkeypatch.setattr(fsutil, "_MAX_MEMO_PATHS", 3)
    mounts = MountTable("21 1 254:0 / / rw - ext4 /dev/vda rw\n30 21 0:40 / /nfs rw - nfs4 srv:/ rw\n")
    assert [mounts.fs_type(p) for p in ("/nfs/a", "/b")] == ["nfs4", "ext4"]  # memoized: /nfs/a, /nfs, /b
    assert mounts.fs_type("/nfs/a") == "nfs4"  # used again: the newest
    assert mounts.fs_type("/c") == "ext4"
    assert len(mounts._memo) == 3 and mounts._memo["/nfs/a"] == "nfs4" and mounts._memo["/c"] == "ext4"
    assert MountTable("").fs_type("/a/b") == ""  # no mount table read: no type, up to the root
