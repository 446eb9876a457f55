"""The process memos are bounded LRUs: at the bound the least recently used entry goes, never the whole memo.

Each memo's bound is its module constant (checked below); the eviction order is checked on a small
LRU of the same kind put in its place, through the functions that read and write it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import weakref

import cachetools
import pytest
from cuda.core import ProgramOptions

import tiered_progcache
from tiered_progcache import TieredProgramCache
from tiered_progcache.compiling import compile as compile_module
from tiered_progcache.compiling import headermemo, keys
from tiered_progcache.compiling.headermemo import FileInfo

from header_support import fresh_header_memo  # noqa: F401  (autouse)


def test_each_memo_is_bounded_by_its_constant():
    assert headermemo._file_memo.maxsize == headermemo.MAX_MEMO_FILES == 200_000
    assert keys._tokenized.maxsize == keys.MAX_MEMO_OPTIONS == 1024
    assert compile_module._saved.maxsize == compile_module._MAX_SAVED == 65536


def _settled(path: str) -> headermemo.Signature:
    old = time.time() - 60  # past the racy window, so remember_file keeps it
    os.utime(path, (old, old))
    return headermemo.signature(path)


def test_the_file_memo_forgets_the_least_recently_used_file_only(tmp_path, monkeypatch):
    monkeypatch.setattr(headermemo, "_file_memo", cachetools.LRUCache(2))
    monkeypatch.setattr(headermemo, "MAX_MEMO_FILES", 2)  # a wipe at the bound would show
    paths = [str(tmp_path / f"h{i}.h") for i in range(3)]
    sigs = []
    for i, path in enumerate(paths):
        with open(path, "w") as fh:
            fh.write(f"#define H{i}\n")
        sigs.append(_settled(path))
    info = FileInfo(b"\0" * 32, ())
    headermemo.remember_file(paths[0], sigs[0], info, parse=False, after=sigs[0])
    headermemo.remember_file(paths[1], sigs[1], info, parse=False, after=sigs[1])
    assert headermemo.known_file(paths[0], sigs[0], parse=False) is info  # now the most recently used
    headermemo.remember_file(paths[2], sigs[2], info, parse=False, after=sigs[2])  # the bound: paths[1] goes
    assert [headermemo.known_file(p, s, parse=False) is info for p, s in zip(paths, sigs)] == [True, False, True]


def test_the_options_memo_forgets_the_least_recently_used_options_only(monkeypatch):
    monkeypatch.setattr(keys, "_tokenized", cachetools.LRUCache(2))
    monkeypatch.setattr(keys, "MAX_MEMO_OPTIONS", 2)
    first, second, third = (ProgramOptions(arch="sm_90", include_path=[f"/opt/i{n}"]) for n in range(3))
    for options in (first, second, first, third):  # first is used again before third arrives
        keys._keyed_options(options, portable=True)
    assert set(keys._tokenized) == {id(first), id(third)}


def test_the_saved_seconds_memo_forgets_the_least_recently_used_key_only(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_module, "_saved", cachetools.LRUCache(2))
    monkeypatch.setattr(compile_module, "_MAX_SAVED", 2)
    with TieredProgramCache(tmp_path / "node") as cache:
        for key in (b"a", b"b", b"a", b"c"):  # no manifests: each remembers None, once
            compile_module._record_hit(cache, key)
            cache.compile_tally.snapshot()  # the tally reads what its hits saved, so the memo learns it now
        memo = id(cache.identity)
        assert set(compile_module._saved) == {(memo, b"a"), (memo, b"c")}


@pytest.mark.parametrize("count", [3, 10])
def test_a_full_file_memo_keeps_exactly_its_bound(tmp_path, monkeypatch, count):
    monkeypatch.setattr(headermemo, "_file_memo", cachetools.LRUCache(3))
    monkeypatch.setattr(headermemo, "MAX_MEMO_FILES", 3)
    info = FileInfo(b"\0" * 32, ())
    for i in range(count):
        path = str(tmp_path / f"f{i}.h")
        with open(path, "w") as fh:
            fh.write("x")
        sig = _settled(path)
        headermemo.remember_file(path, sig, info, parse=False, after=sig)
    assert len(headermemo._file_memo) == 3


def _scan(name: str) -> headermemo.ScanResult:
    return headermemo.ScanResult(name.encode().ljust(32, b"\0"), True, (), (), time.monotonic(), (), (), True, None)


class _Watch:
    """A subscription's one duty here: being released when its scan leaves the memo."""

    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_the_scan_memo_forgets_the_least_recently_used_scan_only_and_releases_its_watch(monkeypatch):
    assert headermemo._scan_memo.maxsize == headermemo.MAX_MEMO_SCANS == 4096
    monkeypatch.setattr(headermemo, "_scan_memo", headermemo._ScanLRU(2))
    scans = {name: _scan(name) for name in "abc"}
    watches = {name: _Watch() for name in "abc"}
    for name, result in scans.items():
        result.watch = watches[name]  # type: ignore[assignment]
    headermemo.memoize(("a",), scans["a"], None, lambda: None)
    headermemo.memoize(("b",), scans["b"], None, lambda: None)
    assert headermemo._scan_memo.get(("a",)) is scans["a"]  # now the most recently used
    headermemo.memoize(("c",), scans["c"], None, lambda: None)  # the bound: b goes, and only b
    assert set(headermemo._scan_memo) == {("a",), ("c",)}
    assert [watches[n].released for n in "abc"] == [0, 1, 0]


def test_a_scans_view_holds_the_scans_own_headers_and_nothing_outlives_the_scan():
    """A view builds no file objects (a fresh process's first CUB hit makes one over 600 headers) and keeps
    nothing beside the scan memo: dropped with its scan."""
    from tiered_progcache.compiling.headerscan import HeaderFile, scan_view

    headers = (HeaderFile("I0", "a.h", "ab" * 32),)
    result = headermemo.ScanResult(b"a" * 32, True, (), (), time.monotonic(), headers, (), True, None)
    options = ProgramOptions(arch="sm_90")
    portable = scan_view(result, options, "c++", True)
    assert portable.headers is headers and portable.result is result and portable.path_free
    assert portable.headers[0].path == "a.h"
    assert not scan_view(result, options, "c++", False).path_free
    gone = weakref.ref(result)
    del result, portable
    assert gone() is None  # no cycle, no memo of views


def test_a_hit_reads_its_manifest_when_the_tally_is_read_not_before(tmp_path, monkeypatch):
    """With no ``on_hit`` hook the hit pays no manifest read; ``stats()`` reads each key's once and counts every hit."""
    sources = [f'extern "C" __global__ void saved{n}(float* x) {{ x[0] = {n}.0f; }}\n' for n in range(2)]
    options = ProgramOptions(arch="sm_90")
    recorded = []
    with TieredProgramCache(tmp_path / "node") as cache:
        for source in sources:
            before = cache.stats().compiling.compile_seconds
            tiered_progcache.compile(source, "c++", options, cache=cache)
            recorded.append(round(cache.stats().compiling.compile_seconds - before, 6))
    monkeypatch.setattr(compile_module, "_saved", cachetools.LRUCache(8))  # a new process's memory
    with TieredProgramCache(tmp_path / "node") as cache:
        for _ in range(3):
            for source in sources:
                tiered_progcache.compile(source, "c++", options, cache=cache)
        assert len(compile_module._saved) == 0  # no manifest read yet
        assert cache.stats().compiling.saved_seconds == pytest.approx(3 * sum(recorded), abs=1e-5)
        assert sorted(s for _, s in compile_module._saved.values()) == pytest.approx(sorted(recorded), abs=2e-6)



def test_a_dead_caches_memo_entry_never_answers_for_a_new_cache_at_its_address(tmp_path, monkeypatch):
    """The saved-seconds memo is keyed by id(cache): once a cache is gone, a new one may get its id.

    What the dead one left under that id must not be the new one's figure (a CI run saw another
    test's compile time reported for this cache's hit).
    """
    from tiered_progcache.compiling.compile import on_hit

    class Gone:
        pass

    gone = Gone()
    dead = weakref.ref(gone)
    del gone
    assert dead() is None
    source = 'extern "C" __global__ void reused(float* x) { x[0] = 4.0f; }\n'
    monkeypatch.setattr(compile_module, "_saved", cachetools.LRUCache(8))
    seen = []
    stop = on_hit(seen.append)
    try:
        with TieredProgramCache(tmp_path / "node") as cache:
            before = cache.stats().compiling.compile_seconds
            tiered_progcache.compile(source, "c++", ProgramOptions(arch="sm_90"), cache=cache)
            recorded = round(cache.stats().compiling.compile_seconds - before, 6)
            (memo,) = compile_module._saved  # the compile remembered its own figure
            compile_module._saved[memo] = (dead, 99.0)  # what a dead cache at this address would have left
            tiered_progcache.compile(source, "c++", ProgramOptions(arch="sm_90"), cache=cache)
            assert cache.stats().compiling.saved_seconds == pytest.approx(recorded, abs=1e-6)
    finally:
        stop()
    assert [e.saved_seconds for e in seen] == [pytest.approx(recorded, abs=1e-6)]
    assert compile_module._saved[memo][1] == pytest.approx(recorded, abs=1e-6)  # read again and remembered


def test_a_hook_reads_each_entrys_manifest_once_per_process(tmp_path, monkeypatch):
    """``on_hit`` reads a key's manifest on its first hit in a process; later hits answer from the memo."""
    from tiered_progcache.compiling.compile import on_hit

    source = 'extern "C" __global__ void once(float* x) { x[0] = 5.0f; }\n'
    with TieredProgramCache(tmp_path / "node") as cache:
        tiered_progcache.compile(source, "c++", ProgramOptions(arch="sm_90"), cache=cache)
    monkeypatch.setattr(compile_module, "_saved", cachetools.LRUCache(8))  # a new process's memory
    decoded = []
    real = compile_module.compile_seconds_of
    monkeypatch.setattr(compile_module, "compile_seconds_of", lambda *a, **k: decoded.append(1) or real(*a, **k))
    seen = []
    stop = on_hit(seen.append)
    try:
        with TieredProgramCache(tmp_path / "node") as cache:
            for _ in range(3):
                tiered_progcache.compile(source, "c++", ProgramOptions(arch="sm_90"), cache=cache)
    finally:
        stop()
    assert len(decoded) == 1
    assert len(seen) == 3 and seen[0].saved_seconds is not None and len({e.saved_seconds for e in seen}) == 1

def test_a_header_changed_between_its_stat_and_its_read_is_hashed_as_it_is_now_and_not_memoized(tmp_path):
    from tiered_progcache.compiling import headerscan

    path = str(tmp_path / "h.h")
    with open(path, "w") as fh:
        fh.write("#define A 1\n")
    stated = _settled(path)
    with open(path, "a") as fh:  # grows after the stat the caller holds
        fh.write("#define B 2\n")
    now = _settled(path)
    info = headerscan._file_info(path, stated, parse=True)
    assert info.digest == hashlib.sha256(b"#define A 1\n#define B 2\n").digest()  # the whole file, as it is now
    assert headermemo.known_file(path, stated, parse=True) is None
    assert headermemo.known_file(path, now, parse=True) is None
    assert headerscan._file_info(path, now, parse=True) == info  # an unchanged read is memoized
    assert headermemo.known_file(path, now, parse=True) == info


@pytest.mark.parametrize("stated_bytes", [60, 63])  # 63: the first read (its size and a byte) ends at the bound
def test_a_header_that_grew_past_the_bound_while_read_is_too_big(tmp_path, monkeypatch, stated_bytes):
    from tiered_progcache.compiling import headerscan

    monkeypatch.setattr(headerscan, "MAX_HEADER_BYTES", 64)
    monkeypatch.setattr(headerscan, "_HASH_CHUNK", 16)
    path = str(tmp_path / "h.h")
    with open(path, "w") as fh:
        fh.write("x" * stated_bytes)
    stated = _settled(path)
    with open(path, "a") as fh:
        fh.write("y" * (70 - stated_bytes))  # 70 bytes now, over the 64-byte bound
    assert headerscan._file_info(path, stated, parse=False) is headerscan._TOO_BIG
    assert headermemo.known_file(path, stated, parse=False) is None


def test_a_header_of_exactly_the_bound_is_hashed_and_one_byte_more_is_too_big(tmp_path, monkeypatch):
    from tiered_progcache.compiling import headerscan

    monkeypatch.setattr(headerscan, "MAX_HEADER_BYTES", 64)
    at, over = str(tmp_path / "at.h"), str(tmp_path / "over.h")
    with open(at, "w") as fh:
        fh.write("x" * 64)
    with open(over, "w") as fh:
        fh.write("x" * 65)
    assert headerscan._file_info(at, _settled(at), parse=False).digest == hashlib.sha256(b"x" * 64).digest()
    assert headerscan._file_info(over, _settled(over), parse=False) is headerscan._TOO_BIG


def test_a_header_hashed_without_its_includes_is_parsed_when_they_are_asked_for(tmp_path):
    from tiered_progcache.compiling import headerscan

    path = str(tmp_path / "h.h")
    with open(path, "w") as fh:
        fh.write('#include "other.h"\n')
    sig = _settled(path)
    assert headerscan._file_info(path, sig, parse=False).includes == ()  # a directory walk's read: no includes
    assert headerscan._file_info(path, sig, parse=True).includes != ()  # read again, and parsed
    assert headermemo.known_file(path, sig, parse=True).includes != ()


def test_an_unchanged_header_is_hashed_from_one_read(tmp_path, monkeypatch):
    """The read the stat's size asks for, and a byte more, is the whole file when the descriptor's fstat agrees."""
    from tiered_progcache.compiling import headerscan

    path = str(tmp_path / "h.h")
    with open(path, "w") as fh:
        fh.write("#define A 1\n" * 100)
    sig = _settled(path)
    reads: list[int] = []
    real_read = os.read

    def counted(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", counted)
    info = headerscan._file_info(path, sig, parse=True)
    monkeypatch.undo()
    assert reads == [1201] and info.digest == hashlib.sha256(b"#define A 1\n" * 100).digest()


def test_the_tally_reads_a_hits_manifest_from_the_node_only(tmp_path, monkeypatch):
    """A hit whose manifest is only on the shared tier saves 0 in ``stats()`` and is counted as a hit of no known
    compile time: the tally never asks the bucket."""
    source = 'extern "C" __global__ void remote_only(float* x) { x[0] = 3.0f; }\n'
    options = ProgramOptions(arch="sm_90")
    (tmp_path / "bucket").mkdir()
    remote = f"file://{tmp_path / 'bucket'}"
    with TieredProgramCache(tmp_path / "node-a", remote=remote) as cache:
        tiered_progcache.compile(source, "c++", options, cache=cache)
        assert cache.flush(60)
    monkeypatch.setattr(compile_module, "_saved", cachetools.LRUCache(8))
    with TieredProgramCache(tmp_path / "node-b", remote=remote, boot_fetch_bytes=0) as cache:
        compiled = tiered_progcache.compile_count()
        tiered_progcache.compile(source, "c++", options, cache=cache)  # the entry from the bucket, not its manifest
        assert tiered_progcache.compile_count() == compiled
        tiered_progcache.compile(source, "c++", options, cache=cache)  # from memory: a second hit, the same key
        compiling = cache.stats().compiling
        assert (compiling.saved_seconds, compiling.hits_without_compile_time) == (0, 2)
        assert [s for _, s in compile_module._saved.values()] == [None]
        assert cache.stats().compiling.hits_without_compile_time == 2  # counted once, not again per snapshot


def test_an_on_hit_hook_gets_the_key_and_one_that_raises_is_logged_by_name(tmp_path, caplog):
    from tiered_progcache.compiling.compile import on_hit

    source = 'extern "C" __global__ void hooked(float* x) { x[0] = 4.0f; }\n'
    options = ProgramOptions(arch="sm_90")
    seen = []

    def failing(event) -> None:
        seen.append(event.key)
        raise RuntimeError("a hook's own bug")

    with TieredProgramCache(tmp_path / "node") as cache:
        tiered_progcache.compile(source, "c++", options, cache=cache)
        stop = on_hit(failing)
        try:
            with caplog.at_level(logging.ERROR, logger="tiered_progcache.compiling.compile"):
                assert tiered_progcache.compile(source, "c++", options, cache=cache).code
        finally:
            stop()
    assert len(seen) == 1 and isinstance(seen[0], bytes) and len(seen[0]) == 32
    assert [r.getMessage().split(" <")[0] for r in caplog.records] == ["on_hit hook"]


@pytest.mark.parametrize("hooked", [False, True])
def test_a_manifest_that_names_another_entry_saves_nothing(tmp_path, monkeypatch, hooked):
    """Kernel B's manifest key holding kernel A's manifest (copied, or a bug): refused, B's hit saves 0 (None)."""
    from tiered_progcache.chain.stats import MetadataKey
    from tiered_progcache.compiling.compile import on_compile, on_hit
    from tiered_progcache.compiling.manifest import manifest_key

    options = ProgramOptions(arch="sm_90")
    sources = [f'extern "C" __global__ void named{n}(float* x) {{ x[0] = {n}.5f; }}\n' for n in range(2)]
    keys_made: list[bytes] = []
    stop = on_compile(lambda event: keys_made.append(event.key))
    try:
        with TieredProgramCache(tmp_path / "node") as cache:
            for source in sources:
                tiered_progcache.compile(source, "c++", options, cache=cache)
            first, second = keys_made
            cache.put(manifest_key(second), cache.get(MetadataKey(manifest_key(first))))
    finally:
        stop()
    monkeypatch.setattr(compile_module, "_saved", cachetools.LRUCache(8))
    seen = []
    stop = on_hit(seen.append) if hooked else (lambda: None)
    try:
        with TieredProgramCache(tmp_path / "node") as cache:
            tiered_progcache.compile(sources[1], "c++", options, cache=cache)
            compiling = cache.stats().compiling
            assert (compiling.saved_seconds, compiling.hits_without_compile_time) == (0, 1)
    finally:
        stop()
    assert [s for _, s in compile_module._saved.values()] == [None]
    assert [event.saved_seconds for event in seen] == ([None] if hooked else [])
