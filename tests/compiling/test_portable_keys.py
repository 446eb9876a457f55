"""Portable keys: the key covers what the compiler reads, not where it lives.

Two hosts with the same headers under different roots compute the same key (real
processes sharing one moto S3 bucket: the second runs NVRTC zero times); a byte changed
in a reachable header changes it; the opt-out and debug compiles keep the key made
before portable keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions
from cuda.core.utils import InMemoryProgramCache, make_program_cache_key

import tiered_progcache as tpc
from tiered_progcache.compiling import headermemo
from tiered_progcache.compiling.headerscan import header_digest, header_scan
from tiered_progcache.compiling.keys import CompileKey, HeaderFile, compile_key
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401
from support import child_pythonpath, options

ARCH = "sm_90"
OLD = time.time() - 3600  # settled mtimes, as in an installed tree

#: A CCCL-shaped tree: nested directories, ``<...>`` and ``"..."`` includes, a ``..``
#: include, a second include directory, and a header nothing includes.
TREE = {
    "include/mylib/config.h": "#pragma once\n#define MYLIB_VER 3\n",
    "include/mylib/core.h": '#pragma once\n#include <mylib/config.h>\n#include "detail/impl.h"\n'
                            "#define CORE (MYLIB_VER + IMPL)\n",
    "include/mylib/detail/impl.h": '#pragma once\n#include "../config.h"\n#include "helpers/help.h"\n'
                                   "#define IMPL (MYLIB_VER * HELP)\n",
    "include/mylib/detail/helpers/help.h": "#pragma once\n#define HELP 2\n",
    "include/mylib/unused.h": "#define UNUSED 1\n",
    "extra/ext.h": "#pragma once\n#define EXT 5\n",
}
REACHABLE = [("I0", "mylib/config.h"), ("I0", "mylib/core.h"), ("I0", "mylib/detail/helpers/help.h"),
             ("I0", "mylib/detail/impl.h"), ("I1", "ext.h")]
SRC = '#include <mylib/core.h>\n#include "ext.h"\nextern "C" __global__ void k(int* out) { *out = CORE + EXT; }\n'


@pytest.fixture(autouse=True)
def _fresh_memo():
    headermemo.clear_memo()
    yield
    headermemo.clear_memo()


def _write(path: Path, text: str, *, settled: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if settled:
        os.utime(path, (OLD, OLD))
    return path


def _tree(root: Path) -> Path:
    for rel, text in TREE.items():
        _write(root / rel, text)
    return root


def _opts(root: Path, **kw) -> ProgramOptions:
    """Options with a host tree's two include roots."""
    return options(root / "include", root / "extra", **kw)


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """The same tree under two roots of different depth, as on a CI runner and on a node."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # the source's directory: a root too, so away from the trees
    return _tree(tmp_path / "ci" / "home" / "runner" / ".venv"), _tree(tmp_path / "node" / "opt" / "venv")


def _cubin(source: str, options: ProgramOptions) -> bytes:
    """A plain NVRTC compile (no cache); the Program is closed here, not by the cycle collector."""
    program = Program(source, "c++", options)
    try:
        return bytes(program.compile("cubin").code)
    finally:
        program.close()


def _location_bound(source: str, options: ProgramOptions, extra_digest: bytes | None = None) -> bytes:
    """The key ``compile()`` made before portable keys (compile.py's ``_combine`` over ``header_digest``)."""
    digest = header_digest(source, options)
    if digest is not None and extra_digest is not None:
        h = hashlib.sha256()
        for part in (extra_digest, digest):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        digest = h.digest()
    elif digest is None:
        digest = extra_digest
    return make_program_cache_key(code=source, code_type="c++", options=options, target_type="cubin",
                                  extra_digest=digest)


# -- same content, same key; any reachable byte, another key ------------------------------------------


def test_the_same_headers_under_different_roots_give_the_same_key(hosts):
    a, b = (compile_key(SRC, "c++", _opts(root), "cubin") for root in hosts)
    assert a.key == b.key and a.portable and b.portable
    assert a.headers == b.headers
    assert [(h.root, h.path) for h in a.headers] == REACHABLE
    assert a.options[-2:] == ("--include-path=<tiered-progcache:I0>", "--include-path=<tiered-progcache:I1>")
    # what cuda-core alone keys (the absolute paths) differs, as does the location-bound key
    assert _location_bound(SRC, _opts(hosts[0])) != _location_bound(SRC, _opts(hosts[1]))


@pytest.mark.parametrize("rel", ["include/mylib/config.h", "include/mylib/detail/helpers/help.h", "extra/ext.h"])
def test_one_byte_changed_in_a_reachable_header_changes_the_key(hosts, rel):
    """config.h is reached through ``..``, help.h three levels down, ext.h on the second directory."""
    root = hosts[1]
    before = compile_key(SRC, "c++", _opts(root), "cubin")
    data = bytearray((root / rel).read_bytes())
    data[-2] = ord("9")  # the number before the final newline: one byte
    (root / rel).write_bytes(bytes(data))
    after = compile_key(SRC, "c++", _opts(root), "cubin")
    assert after.key != before.key
    assert compile_key(SRC, "c++", _opts(hosts[0]), "cubin").key == before.key  # the other host unchanged


def test_a_header_that_is_not_reachable_changing_keeps_the_key(hosts):
    root = hosts[0]
    before = compile_key(SRC, "c++", _opts(root), "cubin").key
    _write(root / "include/mylib/unused.h", "#define UNUSED 2\n")
    _write(root / "include/mylib/brand_new.h", "#define NEW 1\n")
    assert compile_key(SRC, "c++", _opts(root), "cubin").key == before


def test_a_renamed_include_root_with_the_same_content_keeps_the_key(hosts, tmp_path):
    before = compile_key(SRC, "c++", _opts(hosts[0]), "cubin").key
    moved = tmp_path / "elsewhere" / "renamed-venv"
    moved.parent.mkdir()
    hosts[0].rename(moved)
    assert compile_key(SRC, "c++", _opts(moved), "cubin").key == before


def test_swapping_the_include_order_changes_the_key(hosts):
    """Roles are positions on the search path: another order is another search, so another key."""
    root = hosts[0]
    swapped = ProgramOptions(arch=ARCH, include_path=[str(root / "extra"), str(root / "include")])
    a = compile_key(SRC, "c++", _opts(root), "cubin")
    b = compile_key(SRC, "c++", swapped, "cubin")
    assert a.key != b.key
    assert [h.root for h in b.headers] == ["I0", "I1", "I1", "I1", "I1"]


def test_a_relative_include_path_keys_as_the_absolute_one(hosts, monkeypatch):
    root = hosts[0]
    monkeypatch.chdir(root)
    relative = ProgramOptions(arch=ARCH, include_path=["include", "extra"])
    assert compile_key(SRC, "c++", relative, "cubin").key == compile_key(SRC, "c++", _opts(root), "cubin").key


# -- the opt-out, and what cannot be portable -----------------------------------------------------------


@pytest.mark.parametrize("extra_digest", [None, b"user-digest"])
@pytest.mark.parametrize("case", ["include", "pre_include", "name", "plain", "quoted-next-to-source"])
def test_the_opt_out_reproduces_the_key_made_before_portable_keys(hosts, case, extra_digest, monkeypatch):
    root = hosts[0]
    source, options = SRC, _opts(root)
    if case == "pre_include":
        options = _opts(root, pre_include=[str(root / "extra/ext.h"), "mylib/config.h"])
    elif case == "name":
        _write(root / "src" / "near.h", "#define NEAR 1\n")
        source, options = '#include "near.h"\n' + SRC, _opts(root, name=str(root / "src" / "kernel.cu"))
    elif case == "plain":
        source, options = 'extern "C" __global__ void k(int* out) { *out = 1; }\n', ProgramOptions(arch=ARCH)
    elif case == "quoted-next-to-source":
        monkeypatch.chdir(root / "include" / "mylib")
        source, options = '#include "core.h"\nextern "C" __global__ void k(int* out) { *out = CORE; }\n', \
            ProgramOptions(arch=ARCH, include_path=[str(root / "include")])
    ck = compile_key(source, "c++", options, "cubin", extra_digest=extra_digest, portable=False)
    assert ck.key == _location_bound(source, options, extra_digest)
    assert not ck.portable
    assert ck.options == tuple(o.decode() for o in options.as_bytes("nvrtc", "cubin"))


def test_a_plain_compile_keys_as_program_compile_does_either_way():
    """No path among the options and no file read: the key is cuda-core's own, shared with Program.compile."""
    src = 'extern "C" __global__ void k(int* out) { *out = 1; }\n'
    options = ProgramOptions(arch=ARCH, std="c++17")
    core = make_program_cache_key(code=src, code_type="c++", options=options, target_type="cubin")
    for portable in (True, False):
        ck = compile_key(src, "c++", options, "cubin", portable=portable)
        assert ck.key == core
        assert (ck.headers, ck.missing, ck.header_digest) == ((), (), None)
    assert compile_key(src, "c++", options, "cubin").portable


@pytest.mark.parametrize("field", ["debug", "lineinfo", "numba_debug"])
def test_a_compile_with_debug_information_is_keyed_by_path(hosts, field):
    """The binary names each header by absolute path for cuda-gdb and the profilers, which must find
    them on this host: such a compile never shares an entry with a host whose files lie elsewhere."""
    keys = [compile_key(SRC, "c++", _opts(root, **{field: True}), "cubin") for root in hosts]
    assert keys[0].key != keys[1].key
    assert not keys[0].portable
    assert keys[0].key == _location_bound(SRC, _opts(hosts[0], **{field: True}))
    assert keys[0].headers == keys[1].headers  # the files are still reported by role


def test_lineinfo_embeds_the_header_paths_which_is_why_it_is_keyed_by_path(hosts):
    src = '#include <mylib/fn.h>\nextern "C" __global__ void k(int* out) { *out = twice(*out); }\n'
    cubins = []
    for root in hosts:
        _write(root / "include/mylib/fn.h", "#pragma once\n__device__ int twice(int x) { return 2 * x; }\n")
        cubins.append(_cubin(src, _opts(root, lineinfo=True)))
    assert str(hosts[0]).encode() in cubins[0] and str(hosts[1]).encode() in cubins[1]
    without = [_cubin(src, _opts(root)) for root in hosts]
    assert without[0] == without[1]  # no debug information: the same bytes under either root


def test_file_macro_in_release_code_is_keyed_portably_and_names_the_compiling_host(hosts):
    """The accepted difference: ``__FILE__`` (CCCL's assertions) embeds the path the compiler found
    the header at. The key is portable, so a hit may carry the other host's path in such a string."""
    for root in hosts:
        _write(root / "include/mylib/where.h", "#pragma once\n__device__ const char* where() { return __FILE__; }\n")
    src = '#include <mylib/where.h>\nextern "C" __global__ void k(const char** out) { *out = where(); }\n'
    a, b = (compile_key(src, "c++", _opts(root), "cubin") for root in hosts)
    assert a.key == b.key and a.portable
    cubins = [_cubin(src, _opts(root)) for root in hosts]
    assert str(hosts[0] / "include" / "mylib" / "where.h").encode() in cubins[0]
    assert cubins[0] != cubins[1]


def test_an_absolute_include_outside_every_root_keeps_its_path_and_is_not_portable(hosts, tmp_path):
    outside = _write(tmp_path / "shared" / "out.h", "#define OUT 1\n")
    src = f'#include "{outside}"\n' + SRC
    ck = compile_key(src, "c++", _opts(hosts[0]), "cubin")
    assert not ck.portable
    assert HeaderFile("abs", str(outside), hashlib.sha256(outside.read_bytes()).hexdigest()) in ck.headers
    _write(outside, "#define OUT 2\n")
    assert compile_key(src, "c++", _opts(hosts[0]), "cubin").key != ck.key


# -- each path-valued option ------------------------------------------------------------------------------


def test_an_absolute_pre_include_is_keyed_by_role_and_content(hosts, tmp_path):
    keys = [compile_key(SRC, "c++", _opts(root, pre_include=[str(root / "extra/ext.h"), "mylib/config.h"]), "cubin")
            for root in hosts]
    assert keys[0].key == keys[1].key and keys[0].portable
    assert "--pre-include=<tiered-progcache:I1>/ext.h" in keys[0].options
    assert "--pre-include=mylib/config.h" in keys[0].options  # a relative one, as spelled
    _write(hosts[1] / "extra/ext.h", "#pragma once\n#define EXT 6\n")
    assert compile_key(SRC, "c++", _opts(hosts[1], pre_include=[str(hosts[1] / "extra/ext.h")]), "cubin").key \
        != compile_key(SRC, "c++", _opts(hosts[0], pre_include=[str(hosts[0] / "extra/ext.h")]), "cubin").key
    elsewhere = _write(tmp_path / "pre.h", "#define PRE 1\n")
    outside = compile_key(SRC, "c++", _opts(hosts[0], pre_include=str(elsewhere)), "cubin")
    assert not outside.portable and f"--pre-include={elsewhere}" in outside.options


def test_a_source_name_with_a_directory_is_keyed_by_the_source_role(hosts):
    """NVRTC looks for "near.h" next to the named source: that directory is the ``source`` role."""
    for root in hosts:
        _write(root / "src" / "near.h", "#define NEAR 7\n")
    src = '#include "near.h"\n' + SRC
    keys = [compile_key(src, "c++", _opts(root, name=str(root / "src" / "kernel.cu")), "cubin") for root in hosts]
    assert keys[0].key == keys[1].key and keys[0].portable
    assert ("source", "near.h") in [(h.root, h.path) for h in keys[0].headers]
    _write(hosts[1] / "src" / "near.h", "#define NEAR 8\n")
    assert compile_key(src, "c++", _opts(hosts[1], name=str(hosts[1] / "src" / "kernel.cu")), "cubin").key \
        != keys[0].key


def test_a_hit_under_another_source_name_returns_the_callers_name(hosts):
    cache = InMemoryProgramCache()
    names = [str(root / "src" / "kernel.cu") for root in hosts]
    start = tpc.compile_count()
    first = tpc.compile(SRC, "c++", _opts(hosts[0], name=names[0]), cache=cache)
    hit = tpc.compile(SRC, "c++", _opts(hosts[1], name=names[1]), cache=cache)
    assert tpc.compile_count() - start == 1
    assert bytes(hit.code) == bytes(first.code)
    assert hit.name == names[1]


def test_use_pch_and_pch_dir_are_keyed_by_role_and_the_pch_content(hosts, tmp_path):
    def key(root: Path, pch: Path) -> CompileKey:
        return compile_key(SRC, "c++", _opts(root, use_pch=str(pch), pch_dir=str(pch.parent)), "cubin")

    pchs = [tmp_path / "pch-a" / "kernel.pch", tmp_path / "elsewhere" / "pch-b" / "kernel.pch"]
    for pch in pchs:
        pch.parent.mkdir(parents=True)
        pch.write_bytes(b"PCH" * 100)
        os.utime(pch, (OLD, OLD))
    a, b = key(hosts[0], pchs[0]), key(hosts[1], pchs[1])
    assert a.key == b.key and a.portable
    assert {"--use-pch=<tiered-progcache:use_pch>", "--pch-dir=<tiered-progcache:pch_dir>"} <= set(a.options)
    assert HeaderFile("use_pch", "kernel.pch", hashlib.sha256(b"PCH" * 100).hexdigest()) in a.headers
    pchs[1].write_bytes(b"PCH" * 99 + b"pch")
    assert key(hosts[1], pchs[1]).key != a.key


def test_the_bundled_headers_directory_is_keyed_by_role(hosts, monkeypatch, tmp_path):
    """cuda-core names NVRTC's bundled-headers directory under the user's cache directory; what
    NVRTC installs there follows the NVRTC version, which cuda-core keys."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    if (major, minor) < (13, 3):
        pytest.skip(f"use_bundled_headers needs NVRTC >= 13.3 (cuda-core refuses it on {major}.{minor})")
    portable, bound = [], []
    for user in ("alice", "bob"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / user / ".cache"))
        options = _opts(hosts[0], use_bundled_headers=True)
        ck = compile_key(SRC, "c++", options, "cubin")
        assert ck.portable and "--use-bundled-headers=<tiered-progcache:bundled>" in ck.options
        portable.append(ck.key)
        bound.append(compile_key(SRC, "c++", options, "cubin", portable=False).key)
    assert portable[0] == portable[1]
    assert bound[0] != bound[1]


def test_a_changed_option_object_is_keyed_afresh(hosts):
    """The role copy of an options object is remembered; editing the object in place is seen."""
    options = _opts(hosts[0])
    before = compile_key(SRC, "c++", options, "cubin")
    options.include_path.append(str(hosts[0] / "include" / "mylib"))  # mutated in place
    grown = compile_key(SRC, "c++", options, "cubin")
    assert grown.key != before.key and grown.options[-1] == "--include-path=<tiered-progcache:I2>"
    options.max_register_count = 32
    assert compile_key(SRC, "c++", options, "cubin").key != grown.key
    options.max_register_count = 32.0  # equal, but another object: the option string may differ
    assert "--maxrregcount=32.0" in compile_key(SRC, "c++", options, "cubin").options
    options.diag_suppress = [1]
    compile_key(SRC, "c++", options, "cubin")
    options.diag_suppress[0] = 1.0  # equal, in place
    assert "--diag-suppress=1.0" in compile_key(SRC, "c++", options, "cubin").options


# -- what compile() does with it ---------------------------------------------------------------------------


def test_compile_shares_entries_across_roots_and_recompiles_after_an_edit(hosts):
    cache = InMemoryProgramCache()
    start = tpc.compile_count()
    first = tpc.compile(SRC, "c++", _opts(hosts[0]), cache=cache)
    assert bytes(tpc.compile(SRC, "c++", _opts(hosts[1]), cache=cache).code) == bytes(first.code)
    assert tpc.compile_count() - start == 1
    _write(hosts[1] / "include/mylib/detail/helpers/help.h", "#pragma once\n#define HELP 4\n")
    edited = tpc.compile(SRC, "c++", _opts(hosts[1]), cache=cache)
    assert tpc.compile_count() - start == 2
    assert bytes(edited.code) != bytes(first.code)
    # the opt-out keys by path: the other root compiles again
    tpc.compile(SRC, "c++", _opts(hosts[0]), cache=cache, portable_keys=False)
    assert tpc.compile_count() - start == 3


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_portable_keys_must_be_a_bool(bad):
    if bad is not None:  # None is compile()'s "not given": the cache's setting (test_compile.py, the knobs)
        with pytest.raises(TypeError, match="portable_keys"):
            tpc.compile(SRC, "c++", ProgramOptions(arch=ARCH), cache=InMemoryProgramCache(), portable_keys=bad)
    with pytest.raises(TypeError, match="portable"):
        compile_key(SRC, "c++", ProgramOptions(arch=ARCH), "cubin", portable=bad)


# -- real processes: two hosts, one bucket ------------------------------------------------------------------

HOST = """
import hashlib, json, sys
from cuda.core import ProgramOptions
import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.compiling.keys import compile_key
from tiered_progcache.compiling.headerscan import scans_run

args = json.loads(sys.argv[1])
options = ProgramOptions(arch="sm_90", std="c++17", include_path=args["include_path"])
# lease_min_compile_rtts=0: every miss looks before it compiles (the lease case), so a hit is never raced
# by this process's compile (which a busy machine could let win): the counts below are exact.
with TieredProgramCache(args["local_dir"], remote=args["url"], remote_options=args["storage_options"],
                        strict=True, lease_min_compile_rtts=0.0) as cache:
    obj = tpc.compile(args["source"], "c++", options, cache=cache)
    flushed = cache.flush(timeout=60)
    stats = cache.stats()
    remote = stats["remote"]
scans = scans_run()
ck = compile_key(args["source"], "c++", options, "cubin")
print(json.dumps({"compiles": tpc.compile_count(), "key": ck.key.hex(), "portable": ck.portable, "scans": scans,
                  "cubin": hashlib.sha256(bytes(obj.code)).hexdigest(), "flushed": flushed,
                  "remote_writes": remote.writes,
                  # the bucket's entry, read by the lookup or in the boot batch (which direct mode's first read
                  # starts): in a fresh local directory a local hit can only be one the batch brought
                  "cluster_hits": remote.hits + stats["local"].hits}))
"""


def _host(bucket, local_dir: Path, cwd: Path, source: str, include_path: list[str]) -> dict:
    """One host's process: its own working and cache directories, the shared bucket."""
    cwd.mkdir(parents=True, exist_ok=True)
    args = {"local_dir": str(local_dir), "url": bucket.url, "storage_options": bucket.storage_options,
            "source": source, "include_path": include_path}
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    done = subprocess.run([sys.executable, "-c", HOST, json.dumps(args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_hosts_with_the_headers_under_different_roots_compile_once(s3_bucket, tmp_path):
    """The done-when: host B runs NVRTC zero times and gets host A's bytes; editing one header on B
    costs exactly one compile under another key."""
    roots = [_tree(tmp_path / "ci" / "home" / "runner" / ".venv"), _tree(tmp_path / "node" / "opt" / "venv")]
    paths = [[str(root / "include"), str(root / "extra")] for root in roots]
    a = _host(s3_bucket, tmp_path / "ci" / "cache", tmp_path / "ci" / "work", SRC, paths[0])
    # cubin, manifest, direct manifest
    assert (a["compiles"], a["portable"], a["flushed"], a["remote_writes"], a["scans"]) == (1, True, True, 3, 1)
    assert len(_stored(s3_bucket)) == 3

    b = _host(s3_bucket, tmp_path / "node" / "cache", tmp_path / "node" / "work", SRC, paths[1])
    # direct mode: the direct manifest and the entry from the bucket, no scan
    assert (b["compiles"], b["cluster_hits"], b["key"], b["cubin"], b["scans"]) == (0, 1, a["key"], a["cubin"], 0)  # the entry; the direct manifest is metadata

    _write(roots[1] / "include/mylib/detail/helpers/help.h", "#pragma once\n#define HELP 3\n")
    edited = _host(s3_bucket, tmp_path / "node" / "cache", tmp_path / "node" / "work", SRC, paths[1])
    assert (edited["compiles"], edited["scans"]) == (1, 1)
    assert edited["key"] != a["key"] and edited["cubin"] != a["cubin"]
    assert len(_stored(s3_bucket)) == 5  # and the direct manifest, rewritten with the new set


def _stored(bucket) -> list[str]:
    """The bucket's objects but its leases: a host whose lease's delete outran its deadline (a loaded machine)
    leaves the lease to expire by itself, as designed; what is stored is what these tests count."""
    return [name for name in bucket.objects() if "/leases/" not in name]


def _cccl_dir() -> Path | None:
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cccl")
    except Exception:
        return None
    return Path(found) if found and (Path(found) / "cuda/std/type_traits").is_file() else None


def test_two_hosts_with_a_copy_of_real_cccl_under_different_roots_compile_once(s3_bucket, tmp_path):
    """Every CCCL file a ``<cuda/std/type_traits>`` kernel can reach, copied under two roots."""
    cccl = _cccl_dir()
    if cccl is None:
        pytest.skip("CCCL headers not found")
    src = ('#include <cuda/std/type_traits>\n'
           'extern "C" __global__ void k(int* out) { *out = cuda::std::is_same_v<int, int> ? 7 : 0; }\n')
    reached = header_scan(src, ProgramOptions(arch=ARCH, std="c++17", include_path=[str(cccl)]))
    assert reached.path_free and {h.root for h in reached.headers} == {"I0"}
    roots = [tmp_path / "ci" / "venv" / "include" / "cccl", tmp_path / "node" / "opt" / "cuda" / "cccl"]
    for root in roots:
        for h in reached.headers:
            (root / h.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cccl / h.path, root / h.path)
    a = _host(s3_bucket, tmp_path / "ci" / "cache", tmp_path / "ci" / "work", src, [str(roots[0])])
    assert (a["compiles"], a["portable"], a["flushed"]) == (1, True, True)
    b = _host(s3_bucket, tmp_path / "node" / "cache", tmp_path / "node" / "work", src, [str(roots[1])])
    assert (b["compiles"], b["cluster_hits"], b["key"], b["cubin"], b["scans"]) == (0, 1, a["key"], a["cubin"], 0)  # the entry; the direct manifest is metadata


PLAIN = """
import json, sys
from cuda.core import Program, ProgramOptions
from tiered_progcache import TieredProgramCache
from tiered_progcache.compiling.keys import compile_key
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.samples import matmul_source

options = ProgramOptions(arch="sm_90", std="c++17")
with TieredProgramCache(sys.argv[1]) as cache:
    Program(matmul_source(16), "c++", options).compile("cubin", cache=cache)
print(json.dumps({"entries": sorted(e.name for e in LocalDir(sys.argv[1]).iter_entries()),
                  "key": compile_key(matmul_source(16), "c++", options, "cubin").key.hex()}))
"""


def test_program_compile_without_include_paths_keys_the_same_on_every_host(tmp_path):
    """Nothing in a plain compile's key names a place: two processes with other working, home and
    cache directories store the entry under one name, the one compile() keys it by."""
    seen = []
    for host in ("one", "two"):
        home = tmp_path / host / "home"
        (home / "work").mkdir(parents=True)
        env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
                   PYTHONPATH=child_pythonpath())
        done = subprocess.run([sys.executable, "-c", PLAIN, str(tmp_path / host / "cache")], cwd=home / "work",
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert seen[0] == seen[1]
    assert seen[0]["entries"] == [hashlib.sha256(bytes.fromhex(seen[0]["key"])).hexdigest()]
