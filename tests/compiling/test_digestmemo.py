"""The file digest memo persisted in the local cache directory: a new process on the node hashes no known file.

Real processes (subprocess) play the new process where the count is the promise;
``headermemo.clear_memo()`` plays one inside the test process elsewhere (it forgets every
memoized file and scan, and the memo directories loaded). ``headermemo.files_hashed()``
says whether headers were read. Bad memo files are planted on disk, never simulated.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache.compiling import digestmemo, direct, headermemo
from tiered_progcache.compiling.headerscan import file_digest

from header_support import SRC, fresh_header_memo, tree  # noqa: F401  (autouse, fixture)
from header_support import write_header as _write
from support import options as _opts

REPO_ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import json, sys
    from cuda.core import ProgramOptions
    import tiered_progcache as tpc
    from tiered_progcache.compiling import direct, headermemo
    with tpc.TieredProgramCache(sys.argv[2]) as cache:
        tpc.compile(sys.argv[3], "c++", ProgramOptions(arch="sm_90", include_path=[sys.argv[1]]), cache=cache)
    print(json.dumps([tpc.compile_count(), headermemo.files_hashed(), direct.direct_counts().hits]))
    """
)


def _new_process(inc: Path, cache_dir: Path) -> list[int]:
    """``[compiles, files hashed, direct hits]`` of one compile() in a new process on this node."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(inc), str(cache_dir), SRC], check=True,
                         capture_output=True, text=True, cwd=os.getcwd(),
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}).stdout
    return json.loads(out)


def _compile(inc: Path, cache_dir: Path) -> bytes:
    """One compile() here through a cache on ``cache_dir``; the key it used."""
    with tpc.TieredProgramCache(cache_dir) as cache:
        tpc.compile(SRC, "c++", _opts(inc), cache=cache)
        return direct.compile_key(cache, SRC, "c++", _opts(inc), "cubin",
                                  memo_dir=os.path.join(cache_dir, "header-scans")).key


def _memo_file(cache_dir: Path) -> Path:
    (path,) = (cache_dir / "header-scans").glob("files-*.json")
    return path


# -- across processes ------------------------------------------------------------------------------


def test_a_new_process_on_the_node_hashes_no_header_and_compiles_nothing(tree, tmp_path):
    cache_dir = tmp_path / "cache"
    _compile(tree, cache_dir)
    assert {row[0] for row in digestmemo.load(cache_dir / "header-scans").rows()} == {
        str(tree / "a.h"), str(tree / "sub" / "b.h"), str(tree / "sub" / "c.h")}
    assert _new_process(tree, cache_dir) == [0, 0, 1]  # the local direct manifest's set, checked by stat


def test_a_header_edited_under_its_old_mtime_is_a_miss_in_the_next_process(tree, tmp_path):
    """Same size, mtime put back: only the ctime tells, and the memo compares it."""
    cache_dir = tmp_path / "cache"
    before = _compile(tree, cache_dir)
    path = tree / "sub" / "c.h"
    st = os.stat(path)
    path.write_text("#pragma once\n#define C_VAL 4\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_ctime_ns != st.st_ctime_ns
    compiles, hashed, hits = _new_process(tree, cache_dir)
    assert (compiles, hits) == (1, 0) and hashed >= 1
    headermemo.clear_memo()
    after = _compile(tree, cache_dir)
    assert after != before
    assert _new_process(tree, cache_dir) == [0, 0, 1]  # the new digest persisted, and the new set recorded


def test_without_a_local_tier_nothing_is_persisted(tree, tmp_path):
    cache = tpc.TieredProgramCache(tiers=[InMemoryProgramCache()])
    assert cache.local_store is None
    before = set(tmp_path.rglob("*"))
    tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    headermemo._save_all_at_exit()
    assert {p for p in set(tmp_path.rglob("*")) - before if "header-scans" in p.parts} == set()


def test_digests_a_direct_hit_hashed_are_saved_at_exit_not_on_the_hit(tree, tmp_path):
    cache_dir = tmp_path / "cache"
    _compile(tree, cache_dir)
    memo = _memo_file(cache_dir)
    memo.unlink()  # a node whose memo is gone: the hit hashes the set's files ...
    headermemo.clear_memo()
    hashed = headermemo.files_hashed()
    with tpc.TieredProgramCache(cache_dir) as cache:
        tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert headermemo.files_hashed() - hashed == 3 and not memo.exists()
    headermemo._save_all_at_exit()  # ... and the process's exit keeps them for the next one
    assert _new_process(tree, cache_dir) == [0, 0, 1]


# -- what is never trusted ----------------------------------------------------------------------------


def _rewrite_body(path: Path, change) -> None:
    """A well-formed file (its digest matches) whose body ``change`` altered."""
    _, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(body)
    change(doc)
    body = json.dumps(doc).encode()
    head = {"format": digestmemo.FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    path.write_bytes(json.dumps(head).encode() + b"\n" + body)


def _corrupt_body(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


def _another_format(path: Path) -> None:
    head, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(head)
    doc["format"] = "tiered-progcache/header-files/0"
    path.write_bytes(json.dumps(doc).encode() + b"\n" + body)


def _a_path_not_a_str(path: Path) -> None:
    _rewrite_body(path, lambda doc: doc["paths"].__setitem__(0, 7))


def _a_negative_stat(path: Path) -> None:
    _rewrite_body(path, lambda doc: doc["stats"].__setitem__(0, -1))


def _columns_of_other_lengths(path: Path) -> None:
    _rewrite_body(path, lambda doc: doc["stats"].pop())


def _a_short_digest_column(path: Path) -> None:
    _rewrite_body(path, lambda doc: doc.__setitem__("sha256", doc["sha256"][:-2]))


def _oversize(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b" " * digestmemo.MAX_FILE_BYTES)


def _not_json(path: Path) -> None:
    path.write_bytes(b"\x80\x04\x95pickle, never loaded\n.")


def _a_symlink(path: Path) -> None:
    elsewhere = path.with_name("elsewhere.txt")
    os.replace(path, elsewhere)
    path.symlink_to(elsewhere)


@pytest.mark.parametrize("damage", [_corrupt_body, _truncate, _another_format, _a_path_not_a_str, _a_negative_stat,
                                    _columns_of_other_lengths, _a_short_digest_column, _oversize, _not_json,
                                    _a_symlink])
def test_a_bad_memo_file_is_ignored_whole_and_replaced(tree, tmp_path, damage):
    cache_dir = tmp_path / "cache"
    _compile(tree, cache_dir)
    path = _memo_file(cache_dir)
    damage(path)
    assert len(digestmemo.load(cache_dir / "header-scans")) == 0
    headermemo.clear_memo()  # as in a new process
    hashed = headermemo.files_hashed()
    with tpc.TieredProgramCache(cache_dir) as cache:
        tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert headermemo.files_hashed() - hashed == 3  # the set's files hashed again
    headermemo._save_all_at_exit()
    assert not path.is_symlink() and len(digestmemo.load(cache_dir / "header-scans")) == 3  # replaced


def test_a_fresh_header_is_never_recorded_nor_trusted_from_a_planted_row(tree, tmp_path):
    """The racy-mtime rule holds at load: a header modified in the last RACY_NS is hashed, whatever the memo says."""
    memo_dir = tmp_path / "cache" / "header-scans"
    fresh = str(_write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 3\n", mtime=time.time()))
    sig = headermemo.signature(fresh)
    assert headermemo.is_racy(sig)
    true_digest = file_digest(fresh, sig)
    headermemo.save_files(memo_dir)
    assert len(digestmemo.load(memo_dir)) == 0  # never recorded
    assert digestmemo.save(memo_dir, [(fresh, sig, b"\xff" * 32)])  # planted, with its very stat
    headermemo.clear_memo()
    headermemo.load_files(memo_dir)
    hashed = headermemo.files_hashed()
    assert file_digest(fresh, sig) == true_digest
    assert headermemo.files_hashed() - hashed == 1


def test_a_row_whose_stat_differs_is_not_trusted(tree, tmp_path):
    memo_dir = tmp_path / "cache" / "header-scans"
    path = str(tree / "a.h")
    sig = headermemo.signature(path)
    other = (sig[0], sig[1], sig[2], sig[3], sig[4] + 1)  # the ctime of another write
    assert digestmemo.save(memo_dir, [(path, other, b"\xff" * 32)])
    headermemo.load_files(memo_dir)
    assert file_digest(path, sig) == hashlib.sha256((tree / "a.h").read_bytes()).digest()


# -- bounds and the directory ----------------------------------------------------------------------


def _rows(tmp_path: Path, names: str) -> list[digestmemo.Row]:
    return [(str(tmp_path / n), ("f", i, 1, 10**18, 10**18), bytes([i]) * 32) for i, n in enumerate(names, 1)]


def test_the_default_bounds_are_the_documented_50000_entries_and_16_mib():
    assert (digestmemo.MAX_ENTRIES, digestmemo.MAX_FILE_BYTES) == (50_000, 16 << 20)


def test_a_save_keeps_its_own_rows_first_then_those_on_disk_up_to_max_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(digestmemo, "MAX_ENTRIES", 3)
    a, b, c, d = _rows(tmp_path, "abcd")
    assert digestmemo.save(tmp_path / "m", [a, b])
    assert digestmemo.save(tmp_path / "m", [c, d, a])  # a again: once, where this save puts it
    assert [r[0] for r in digestmemo.load(tmp_path / "m").rows()] == [c[0], d[0], a[0]]
    assert digestmemo.load(tmp_path / "m").rows() == [c, d, a]  # every field read back exactly


def test_a_save_over_max_file_bytes_keeps_the_newest_rows_within_it(tmp_path, monkeypatch):
    monkeypatch.setattr(digestmemo, "MAX_FILE_BYTES", 2048)
    rows = [(str(tmp_path / ("x" * 100 + str(i))), ("f", i, 1, 1, 1), b"\1" * 32) for i in range(40)]
    assert digestmemo.save(tmp_path / "m", rows)
    kept = digestmemo.load(tmp_path / "m").rows()
    assert os.path.getsize(digestmemo.memo_path(tmp_path / "m")) <= 2048
    assert 0 < len(kept) < 40 and kept == rows[: len(kept)]


def test_a_save_removes_other_formats_files_and_stale_staged_ones(tmp_path):
    memo_dir = tmp_path / "m"
    memo_dir.mkdir()
    (memo_dir / "files-0000000000000000.json").write_text("another format's")
    staged, young = memo_dir / "stage-old", memo_dir / "stage-young"
    staged.write_text("a writer killed before its rename")
    young.write_text("a writer at work")
    os.utime(staged, (time.time() - 7200, time.time() - 7200))
    (memo_dir / "scan.json").write_text("not ours")
    assert digestmemo.save(memo_dir, _rows(tmp_path, "a"))
    assert sorted(p.name for p in memo_dir.iterdir()) == sorted(
        [os.path.basename(digestmemo.memo_path(memo_dir)), "stage-young", "scan.json"])


def test_the_directory_is_made_with_the_librarys_modes_and_never_through_a_symlink(tmp_path):
    child = textwrap.dedent(
        """
        import os, sys
        os.umask(0)
        from tiered_progcache.compiling import digestmemo
        assert digestmemo.save(sys.argv[1], [(sys.argv[1] + "/a.h", ("f", 1, 1, 1, 1), bytes(32))])
        """
    )
    memo_dir = tmp_path / "cache" / "header-scans"
    memo_dir.parent.mkdir()
    subprocess.run([sys.executable, "-c", child, str(memo_dir)], check=True, cwd=REPO_ROOT,
                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert not os.stat(memo_dir).st_mode & stat.S_IWOTH
    assert not os.stat(digestmemo.memo_path(memo_dir)).st_mode & (stat.S_IWOTH | stat.S_IWGRP)
    planted = tmp_path / "other" / "header-scans"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted.parent.mkdir()
    planted.symlink_to(elsewhere)
    assert not digestmemo.save(planted, _rows(tmp_path, "a"))
    assert list(elsewhere.iterdir()) == []
