"""The memo (headermemo): what a warm call reads (nothing, or exactly the files a stat cannot vouch for),
and the checks that keep a memoized scan honest (stat signatures, the racy window, symlinks retargeted)."""

from __future__ import annotations

import os

from tiered_progcache.compiling import headermemo
from tiered_progcache.compiling.headerscan import header_digest, header_scan

from header_support import KERNEL, OLD, SRC, fresh_header_memo, tree  # noqa: F401  (autouse, fixtures)
from header_support import include_opts as _opts
from header_support import write_header as _write


# -- what a warm call reads, and when a stat vouches for a file --------------------------------


def test_touching_without_change_keeps_the_digest_and_rehashes_only_that_file(tree):
    before = header_digest(SRC, _opts(tree))
    hashed = headermemo.files_hashed()
    os.utime(tree / "sub" / "b.h", (OLD + 60, OLD + 60))
    assert header_digest(SRC, _opts(tree)) == before
    assert headermemo.files_hashed() - hashed == 1


def test_a_warm_memo_hashes_nothing(tree):
    header_digest(SRC, _opts(tree))
    hashed = headermemo.files_hashed()
    for _ in range(50):
        header_digest(SRC, _opts(tree))
    assert headermemo.files_hashed() == hashed
    headermemo.clear_memo()
    header_digest(SRC, _opts(tree))
    assert headermemo.files_hashed() - hashed == 3  # a.h, b.h, c.h: the reachable ones only


def test_a_freshly_written_header_is_rehashed_until_it_settles(tree):
    """Two edits inside one coarse clock tick can leave size, mtime and ctime alike, so a
    stat cannot vouch for a header modified in the last RACY_NS: it is read every time."""
    _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 5\n", mtime=None)
    first = header_digest(SRC, _opts(tree))
    hashed = headermemo.files_hashed()
    assert header_digest(SRC, _opts(tree)) == first
    assert headermemo.files_hashed() - hashed == 1  # c.h, read again; a.h and b.h trusted
    os.utime(tree / "sub" / "c.h", (OLD, OLD))  # settled now
    header_digest(SRC, _opts(tree))
    hashed = headermemo.files_hashed()
    header_digest(SRC, _opts(tree))
    assert headermemo.files_hashed() == hashed


def test_recheck_window_trusts_a_scan_for_that_long(tree):
    before = header_digest(SRC, _opts(tree), recheck_s=3600)
    _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 8\n")
    assert header_digest(SRC, _opts(tree), recheck_s=3600) == before  # trusted, as asked
    assert header_digest(SRC, _opts(tree)) != before  # recheck_s=0 looks again


def test_a_warm_scan_returns_the_files_without_reading_any(tree):
    first = header_scan(SRC, _opts(tree))
    hashed = headermemo.files_hashed()
    again = header_scan(SRC, _opts(tree))
    assert headermemo.files_hashed() == hashed
    assert again.headers is first.headers  # the memoized tuple, not a rebuilt one


# -- symlinks a memoized scan went through -----------------------------------------------------


def test_retargeting_a_symlinked_directory_changes_the_digest_on_a_warm_memo(tmp_path):
    for name, val in (("one", 1), ("two", 2)):
        _write(tmp_path / name / "sub" / "x.h", '#include "../b.h"\n')
        _write(tmp_path / name / "b.h", f"#define VAL {val}\n")
    (tmp_path / "inc").mkdir()
    link = tmp_path / "inc" / "sub"
    link.symlink_to(tmp_path / "one" / "sub")
    src = '#include "sub/x.h"' + KERNEL
    before = header_digest(src, _opts(tmp_path / "inc"))
    assert header_digest(src, _opts(tmp_path / "inc")) == before
    link.unlink()
    link.symlink_to(tmp_path / "two" / "sub")
    assert header_digest(src, _opts(tmp_path / "inc")) != before


def test_directories_resolved_together_lstat_each_component_once_a_link_on_the_way_too(tmp_path, monkeypatch):
    """The memo ``resolve`` shares: a component already resolved costs nothing, a new one one ``lstat``,
    behind a symbolic link as in front of one (``/usr/local/cuda -> cuda-13.0``)."""
    base = tmp_path.resolve() / "t"
    (base / "a" / "b" / "c").mkdir(parents=True)
    (base / "a" / "d").mkdir()
    (tmp_path.resolve() / "via").symlink_to(base)
    seen: list[str] = []
    real_lstat = os.lstat

    def counting_lstat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(os.fspath(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", counting_lstat)
    memo: dict[str, str] = {"/": "/"}
    dirs = [f"{base}/a/b/c", f"{base}/a/b", f"{base}/a/d", f"{base}/a"]
    assert [headermemo.resolve(d, memo) for d in dirs] == dirs
    prefixes = {d[:i] for d in dirs for i in range(1, len(d) + 1) if i == len(d) or d[i] == "/"}
    assert sorted(seen) == sorted(prefixes - {"/"})  # each component once
    via = f"{tmp_path.resolve()}/via"
    assert headermemo.resolve(f"{via}/a", memo) == f"{base}/a"
    seen.clear()
    for rel, real in (("a/b", "a/b"), ("a/b/c", "a/b/c"), ("a/d", "a/d")):
        assert headermemo.resolve(f"{via}/{rel}", memo) == f"{base}/{real}"
    assert seen == [f"{base}/a/b", f"{base}/a/b/c", f"{base}/a/d"]  # behind the link: one lstat each
    assert [headermemo.resolve(f"{via}/{rel}", memo) for rel in ("a/b", "a/b/c")] == [f"{base}/a/b", f"{base}/a/b/c"]
    assert len(seen) == 3  # asked again: from the memo


def test_the_realpath_check_answers_exactly_as_realpath(tmp_path):
    """A directory recorded as its own real path is checked by one lstat per shared component: the answer
    must be ``os.path.realpath(d) == real`` for every shape of path (links on the way, a link loop, a
    link to ``.``, a missing component, ``..``, ``//``), alone and many at once."""
    real = tmp_path / "real"
    (real / "a" / "b").mkdir(parents=True)
    (tmp_path / "via").symlink_to(real)
    (real / "a" / "here").symlink_to(".")
    (real / "a" / "loop").symlink_to("loop")
    (real / "a" / "up").symlink_to("..")
    base = str(real)
    (real / "a" / "rel").symlink_to("../a/b")
    (real / "a" / "b" / "back").symlink_to(tmp_path / "via" / "a")
    dirs = [base, f"{base}/a", f"{base}/a/b", f"{tmp_path}/via/a/b", f"{base}/a/here", f"{base}/a/here/b",
            f"{tmp_path}/via", f"{tmp_path}/via/a", f"{base}/a/rel", f"{base}/a/rel/back/b", f"{tmp_path}/via/a/rel",
            f"{tmp_path}/via/missing/x", f"{base}/a/b/back/here/rel",
            f"{base}/a/loop", f"{base}/a/loop/x", f"{base}/a/up/a", f"{base}/missing/x", f"{base}/a/../a/b",
            f"{base}/a/./b", "/" + f"{base}/a", f"{base}/a/b/"]
    pairs = []
    for d in dirs:
        for recorded in {d, os.path.realpath(d), f"{base}/a/b"}:
            assert headermemo._same_realpaths(((d, recorded),)) == (os.path.realpath(d) == recorded), (d, recorded)
            pairs.append((d, recorded))
    for order in (dirs, dirs[::-1], sorted(dirs), sorted(dirs, key=len)):
        shared: dict[str, str] = {"/": "/"}  # one memo across the paths, as a validation shares it
        assert [headermemo.resolve(d, shared) for d in order] == [os.path.realpath(d) for d in order]
        assert all(headermemo.resolve(d, shared) == os.path.realpath(d) for d in order)  # answered from the memo
    good = tuple((d, r) for d, r in pairs if os.path.realpath(d) == r)
    assert headermemo._same_realpaths(good)
    for bad in [(d, r) for d, r in pairs if os.path.realpath(d) != r]:
        assert not headermemo._same_realpaths((*good, bad))  # a shared component seen earlier never hides it
    # the common case turned bad: an ancestor swapped for a symlink to an identical copy
    (tmp_path / "copy" / "a" / "b").mkdir(parents=True)
    recorded = ((f"{base}/a/b", f"{base}/a/b"), (f"{base}/a", f"{base}/a"))
    assert headermemo._same_realpaths(recorded)
    os.rename(real / "a", tmp_path / "old-a")
    (real / "a").symlink_to(tmp_path / "copy" / "a")
    assert not headermemo._same_realpaths(recorded)
