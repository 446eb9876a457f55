"""Issue 18's six findings: where the header key missed what NVRTC opens, each checked against NVRTC itself.

Every test here failed on a51b919 (the stale cubin, the shared key, the whole working
directory read, the machine paths in a manifest, the 1,691-file CUB scan) and pins the fix.
``nvrtc_oracle.opened_by_nvrtc`` records, by inotify ``IN_OPEN``, what NVRTC really opened.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from pathlib import Path

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache.compiling import headermemo, headerscan, headerwatch
from tiered_progcache.compiling.explain import explain
from tiered_progcache.compiling.keys import compile_key
from tiered_progcache.compiling.manifest import build_manifest, compile_inputs, encode_manifest

from header_support import OLD, fresh_header_memo, write_header  # noqa: F401  (autouse)
from nvrtc_oracle import opened_by_nvrtc

compile_module = importlib.import_module("tiered_progcache.compiling.compile")  # the module, not the function
ARCH = "sm_90"
KERNEL = '\nextern "C" __global__ void k(int* out) { *out = V; }\n'


def _key(src: str, opts: ProgramOptions, **kw) -> bytes:
    return compile_key(src, "c++", opts, "cubin", **kw).key


def _covered_paths(src: str, opts: ProgramOptions) -> set[str]:
    """Real paths of every file the header scan digests for this compile."""
    roots = {f"I{i}": p for i, p in enumerate(opts.include_path or [])}
    name = opts.name
    roots["source"] = os.path.dirname(name) if name and "/" in name else os.getcwd()
    roots["cwd"] = os.getcwd()
    scan = headerscan.header_scan(src, opts)
    return {os.path.realpath(h.path if h.root == "abs" else os.path.join(roots[h.root], h.path)) for h in scan.headers}


# -- finding 1: a relative pre_include is read from the working directory ---------------------------


@pytest.mark.parametrize("extra", [{}, {"no_source_include": True}])
def test_a_relative_pre_include_is_found_in_the_working_directory_and_keyed(tmp_path, monkeypatch, extra):
    src_dir, work = tmp_path / "src", tmp_path / "work"
    src_dir.mkdir()
    cfg = write_header(work / "cfg.h", "#define V 1\n")
    write_header(src_dir / "cfg.h", "#define V 9\n")  # NVRTC does not look here for a pre_include
    monkeypatch.chdir(work)
    opts = ProgramOptions(arch=ARCH, name=str(src_dir / "k.cu"), pre_include="cfg.h", **extra)
    opened, ok = opened_by_nvrtc(KERNEL, opts, [str(tmp_path)])
    assert ok and opened == {str(cfg.resolve())}
    assert _covered_paths(KERNEL, opts) == opened
    cache = InMemoryProgramCache()
    start = tpc.compile_count()
    first = tpc.compile(KERNEL, "c++", opts, cache=cache)
    write_header(cfg, "#define V 2\n")
    second = tpc.compile(KERNEL, "c++", opts, cache=cache)
    assert tpc.compile_count() - start == 2 and bytes(first.code) != bytes(second.code)


def test_a_pre_include_not_in_the_working_directory_is_taken_from_the_include_path(tmp_path, monkeypatch):
    inc, work = tmp_path / "inc", tmp_path / "work"
    found = write_header(inc / "cfg.h", "#define V 1\n")
    work.mkdir()
    monkeypatch.chdir(work)
    opts = ProgramOptions(arch=ARCH, name="k.cu", pre_include="cfg.h", include_path=[str(inc)])
    opened, ok = opened_by_nvrtc(KERNEL, opts, [str(tmp_path)])
    assert ok and opened == {str(found.resolve())} == _covered_paths(KERNEL, opts)
    write_header(work / "cfg.h", "#define V 2\n")  # now the working directory's shadows it
    assert opened_by_nvrtc(KERNEL, opts, [str(tmp_path)])[0] == {str((work / "cfg.h").resolve())}
    assert _covered_paths(KERNEL, opts) >= {str((work / "cfg.h").resolve())}


def test_two_hosts_with_different_working_directory_pre_includes_never_share_a_key(tmp_path, monkeypatch):
    keys = []
    for host, value in (("a", 1), ("b", 2)):
        src_dir, work = tmp_path / host / "src", tmp_path / host / "work"
        src_dir.mkdir(parents=True)
        write_header(work / "cfg.h", f"#define V {value}\n")
        monkeypatch.chdir(work)
        keys.append(_key(KERNEL, ProgramOptions(arch=ARCH, name=str(src_dir / "k.cu"), pre_include="cfg.h")))
    assert keys[0] != keys[1]


# -- finding 2: a computed include pointing outside the walked directories -------------------------


@pytest.mark.parametrize("spelling", ["{root}/elsewhere/v.h", "../elsewhere/v.h"])
def test_a_computed_include_outside_every_root_is_keyed_by_path_and_content(tmp_path, monkeypatch, spelling):
    src_dir, work = tmp_path / "src", tmp_path / "work"
    src_dir.mkdir()
    work.mkdir()
    monkeypatch.chdir(work)
    v = write_header(tmp_path / "elsewhere" / "v.h", "#define V 1\n")
    src = f'#define HDR "{spelling.format(root=tmp_path)}"\n#include HDR' + KERNEL
    opts = ProgramOptions(arch=ARCH, name=str(src_dir / "k.cu"))
    opened, ok = opened_by_nvrtc(src, opts, [str(tmp_path)])
    assert ok and opened == {str(v.resolve())} == _covered_paths(src, opts)
    ck = compile_key(src, "c++", opts, "cubin")
    assert not ck.portable and ck.declined is None
    write_header(v, "#define V 2\n")
    assert _key(src, opts) != ck.key


# -- finding 3: a header added to a walked directory whose mtime is put back -----------------------


@pytest.mark.parametrize("watched", [True, False])
def test_a_shadowing_header_added_with_the_directory_mtime_restored_is_seen(tmp_path, monkeypatch, watched):
    i0, i1 = tmp_path / "I0", tmp_path / "I1"
    # ANGLE(v.h) is no single macro name: the scanner walks both include directories whole
    write_header(i1 / "top.h", "#define ANGLE(x) <x>\n#include ANGLE(v.h)\n")
    write_header(i1 / "v.h", "#define V 1\n")
    i0.mkdir()
    for directory in (i0, i1):
        os.utime(directory, (OLD, OLD))  # settled: the scan is memoized and trusted (RACY_NS)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    if not watched:
        monkeypatch.setattr(headerwatch, "_instance", None)  # stat validation only
    opts = ProgramOptions(arch=ARCH, include_path=[str(i0), str(i1)])
    src = "#include <top.h>" + KERNEL
    memo_dir = tmp_path / "header-scans"
    before = _key(src, opts, memo_dir=memo_dir)
    for _ in range(3):  # validated by stat, then (watched) on inotify's word
        assert _key(src, opts, memo_dir=memo_dir) == before
    write_header(i0 / "v.h", "#define V 0\n")
    os.utime(i0, (OLD, OLD))  # as cp -p, rsync -t and tar x do
    assert opened_by_nvrtc(src, opts, [str(tmp_path)])[0] >= {str((i0 / "v.h").resolve())}
    by_stat = headermemo.validation_counts().by_stat
    in_process = _key(src, opts, memo_dir=memo_dir)
    assert in_process != before
    if watched and headerwatch.watcher() is not None:  # the event on I0 forced a rescan, not a stat re-check
        assert headermemo.validation_counts().by_stat == by_stat
    headermemo.clear_memo()  # the next process: only the persisted scan is left
    assert _key(src, opts, memo_dir=memo_dir) == in_process


def test_a_persisted_scan_is_not_reused_when_a_walked_directory_changed_under_a_restored_mtime(tmp_path, monkeypatch):
    i0, i1 = tmp_path / "I0", tmp_path / "I1"
    write_header(i1 / "top.h", "#define ANGLE(x) <x>\n#include ANGLE(v.h)\n")
    write_header(i1 / "v.h", "#define V 1\n")
    i0.mkdir()
    for directory in (i0, i1):
        os.utime(directory, (OLD, OLD))  # settled: the scan is memoized and trusted (RACY_NS)
    monkeypatch.chdir(tmp_path)
    opts = ProgramOptions(arch=ARCH, include_path=[str(i0), str(i1)])
    src = "#include <top.h>" + KERNEL
    memo_dir = tmp_path / "header-scans"
    before = _key(src, opts, memo_dir=memo_dir)
    headermemo.clear_memo()  # a new process ...
    write_header(i0 / "v.h", "#define V 0\n")
    os.utime(i0, (OLD, OLD))
    assert _key(src, opts, memo_dir=memo_dir) != before  # ... does not trust the persisted scan


# -- finding 4: never read the working directory wholesale ------------------------------------------


def test_a_computed_include_in_the_main_source_declines_instead_of_reading_the_working_directory(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    with open(work / "checkpoint.bin", "wb") as fh:  # sparse: 64 MiB of nothing, cheap to make
        fh.truncate(64 << 20)
    write_header(work / "v.h", "#define V 1\n")
    monkeypatch.chdir(work)
    src = "#define STR(x) #x\n#include STR(v.h)" + KERNEL
    opts = ProgramOptions(arch=ARCH)
    hashed = headermemo.files_hashed()
    ck = compile_key(src, "c++", opts, "cubin")
    assert headermemo.files_hashed() == hashed  # not one file of the working directory was read
    assert ck.declined is not None and "working directory" in ck.declined
    cache = tpc.TieredProgramCache(tmp_path / "cache")
    start, declined = tpc.compile_count(), compile_module.declined_count()
    tpc.compile(src, "c++", opts, cache=cache)
    tpc.compile(src, "c++", opts, cache=cache)
    assert tpc.compile_count() - start == 2 and compile_module.declined_count() - declined == 2
    assert len(cache) == 0  # nothing stored
    assert any("not cached" in line for line in explain(src, "c++", opts, cache=cache).lines())


def test_a_working_directory_of_root_is_never_walked(tmp_path, monkeypatch):
    write_header(tmp_path / "top.h", "#define ANGLE(x) <x>\n#include ANGLE(v.h)\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir("/")
    hashed = headermemo.files_hashed()
    in_source = headerscan.header_scan("#define STR(x) #x\n#include STR(v.h)" + KERNEL, ProgramOptions(arch=ARCH))
    assert in_source.declined is not None and headermemo.files_hashed() == hashed
    # an include directory above the working directory: never walked whole either
    monkeypatch.chdir(tmp_path / "work")
    scan = headerscan.header_scan("#include <top.h>" + KERNEL, ProgramOptions(arch=ARCH, include_path=[str(tmp_path)]))
    assert scan.declined is not None and "working directory" in scan.declined
    assert headermemo.files_hashed() == hashed + 1  # top.h alone


def test_a_header_over_the_size_bound_declines_without_being_read(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    inc.mkdir()
    with open(inc / "huge.h", "wb") as fh:
        fh.truncate(headerscan.MAX_HEADER_BYTES + 1)
    monkeypatch.chdir(tmp_path)
    hashed = headermemo.files_hashed()
    scan = headerscan.header_scan("#include <huge.h>" + KERNEL, ProgramOptions(arch=ARCH, include_path=[str(inc)]))
    assert scan.declined is not None and str(headerscan.MAX_HEADER_BYTES) in scan.declined
    assert headermemo.files_hashed() == hashed


def test_a_header_at_the_size_bound_is_hashed_by_streaming(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    inc.mkdir()
    monkeypatch.setattr(headerscan, "MAX_HEADER_BYTES", 3 << 20)
    (inc / "big.h").write_bytes(b"// " + b"x" * ((3 << 20) - 4) + b"\n")
    monkeypatch.chdir(tmp_path)
    opts = ProgramOptions(arch=ARCH, include_path=[str(inc)])
    scan = headerscan.header_scan("#include <big.h>" + KERNEL, opts)
    assert scan.declined is None and [h.path for h in scan.headers] == ["big.h"]


def test_a_directory_walk_past_its_file_bound_declines(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    write_header(inc / "top.h", "#define ANGLE(x) <x>\n#include ANGLE(v.h)\n")
    for i in range(5):
        write_header(inc / f"h{i}.h", "\n")
    monkeypatch.chdir(tmp_path)
    opts = ProgramOptions(arch=ARCH, include_path=[str(inc)])
    monkeypatch.setattr(headerscan, "MAX_WALK_FILES", 6)  # top.h and five more: within the bound
    assert headerscan.header_scan("#include <top.h>" + KERNEL, opts).declined is None
    headermemo.clear_memo()
    monkeypatch.setattr(headerscan, "MAX_WALK_FILES", 5)
    assert "5 files" in headerscan.header_scan("#include <top.h>" + KERNEL, opts).declined


# -- finding 5: manifests of path-keyed compiles ---------------------------------------------------


@pytest.mark.parametrize("kw", [{"portable_keys": False}, {"debug": True}, {"lineinfo": True}])
def test_a_path_keyed_manifest_holds_no_machine_path(tmp_path, monkeypatch, kw):
    inc, work = tmp_path / "machine-specific-inc", tmp_path / "work"
    write_header(inc / "a.h", "#define V 1\n")
    write_header(tmp_path / "outside" / "o.h", "\n")
    work.mkdir()
    monkeypatch.chdir(work)
    portable = kw.pop("portable_keys", True)
    opts = ProgramOptions(arch=ARCH, include_path=[str(inc)], name=str(work / "k.cu"),
                          pre_include=str(tmp_path / "outside" / "o.h"), **kw)
    src = "#include <a.h>" + KERNEL
    ck = compile_key(src, "c++", opts, "cubin", portable=portable)
    assert any(str(inc) in o for o in ck.options)  # the key itself is by path
    document = encode_manifest(build_manifest(ck.key, compile_inputs(ck, src, "c++", opts, "cubin"), 0.1))
    assert str(tmp_path).encode() not in document
    assert b"<tiered-progcache:I0>" in document and b"<redacted:sha256:" in document


# -- finding 6: CCCL's __has_include through a macro ------------------------------------------------


def _cccl_dir() -> str | None:
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cccl")
    except Exception:
        return None
    return found if found and os.path.isfile(os.path.join(found, "cuda/std/type_traits")) else None


@pytest.fixture(scope="module")
def private_cccl(tmp_path_factory) -> str:
    """A copy of the CCCL headers that only this module's compiles open: inotify sees every process's opens, and
    another test worker compiling a CCCL kernel at the same time would add its headers to the watch."""
    cccl = _cccl_dir()
    if cccl is None:
        pytest.skip("CCCL headers not found")
    copy = tmp_path_factory.mktemp("private") / "cccl"
    shutil.copytree(cccl, copy, symlinks=True)
    return str(copy)


@pytest.mark.parametrize("include, bound", [("cuda/std/type_traits", 400), ("cub/block/block_reduce.cuh", 1000)])
def test_cccl_kernels_digest_what_they_can_include_and_every_file_nvrtc_opens(tmp_path, monkeypatch, include, bound,
                                                                              private_cccl):
    cccl = private_cccl
    monkeypatch.chdir(tmp_path)
    opts = ProgramOptions(arch=ARCH, include_path=[cccl], std="c++17")
    src = f"#include <{include}>" + KERNEL.replace("V", "1")
    scan = headerscan.header_scan(src, opts)
    assert scan.declined is None and len(scan.headers) < bound  # a51b919: all 1,691 files of the tree
    opened, ok = opened_by_nvrtc(src, opts, [cccl])
    assert ok and opened and opened <= _covered_paths(src, opts)
