"""The scan (headerscan): which file changes change the digest, which do not, NVRTC's search order, the
roles the portable digest names files by, and the compile helper over it with real NVRTC."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions
from cuda.core.utils import InMemoryProgramCache, make_program_cache_key

import tiered_progcache as tpc
from tiered_progcache.compiling.headerscan import (MAX_HEADER_BYTES, HeaderFile, header_digest, header_scan,
                                                  needs_header_digest)

from header_support import KERNEL, OLD, SRC, fresh_header_memo, tree, valdir  # noqa: F401  (autouse, fixtures)
from header_support import include_opts as _opts
from header_support import write_header as _write

ARCH = "sm_90"


# -- what changes the digest -------------------------------------------------------------------


def test_editing_a_reachable_header_changes_the_digest(tree):
    before = header_digest(SRC, _opts(tree))
    _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 4\n")  # two includes deep
    assert header_digest(SRC, _opts(tree)) != before


def test_editing_an_unreachable_file_keeps_the_digest(tree):
    before = header_digest(SRC, _opts(tree))
    _write(tree / "unrelated.h", "#define NOT_USED 2\n")
    _write(tree / "sub" / "also_unrelated.h", "#define ALSO_NOT_USED 2\n")
    _write(tree / "new_file.h", "#define NEW 1\n")
    assert header_digest(SRC, _opts(tree)) == before


def test_a_header_appearing_earlier_on_the_path_changes_the_digest(tree, tmp_path):
    early = tmp_path / "early"
    early.mkdir()
    opts = ProgramOptions(arch=ARCH, include_path=[str(early), str(tree)])
    before = header_digest(SRC, opts)
    _write(early / "a.h", "#define A_VAL 99\n")  # now shadows inc/a.h
    assert header_digest(SRC, opts) != before


def test_a_missing_header_is_keyed_by_name_and_its_arrival_changes_the_digest(tree):
    src = "#include <not_there_yet.h>\n" + SRC
    before = header_digest(src, _opts(tree))
    assert before != header_digest(SRC, _opts(tree))  # the name alone counts
    _write(tree / "not_there_yet.h", "#define LATE 1\n")
    assert header_digest(src, _opts(tree)) != before


def test_computed_include_falls_back_to_the_whole_include_directory(tree):
    # a computed include the scanner cannot read (a function-like macro), in a header of the include path
    _write(tree / "computed.h", "#define STR(x) #x\n#include STR(a.h)\n")
    src = '#include <computed.h>\nextern "C" __global__ void k(int* out) { *out = A_VAL; }\n'
    before = header_digest(src, _opts(tree))
    _write(tree / "unrelated.h", "#define NOT_USED 3\n")  # not reachable by name, but could be
    after_edit = header_digest(src, _opts(tree))
    assert after_edit != before
    _write(tree / "sub" / "brand_new.h", "#define BRAND_NEW 1\n")  # a new file too
    assert header_digest(src, _opts(tree)) != after_edit
    # ... and without the computed include the same edits do not matter
    plain = header_digest(SRC, _opts(tree))
    _write(tree / "unrelated.h", "#define NOT_USED 4\n")
    assert header_digest(SRC, _opts(tree)) == plain


def test_quoted_include_next_to_the_source_is_keyed_without_any_include_path(tree):
    """NVRTC reads "x.h" from the working directory (the source's directory): cuda-core's key misses that."""
    _write(Path.cwd() / "local.h", "#define LOCAL_VAL 1\n")
    src = '#include "local.h"\nextern "C" __global__ void k(int* out) { *out = LOCAL_VAL; }\n'
    opts = ProgramOptions(arch=ARCH)
    assert not needs_header_digest(opts)
    before = header_digest(src, opts)
    assert before is not None
    _write(Path.cwd() / "local.h", "#define LOCAL_VAL 2\n")
    assert header_digest(src, opts) != before
    # no_source_include turns that lookup off, and with it the digest
    assert header_digest(src, ProgramOptions(arch=ARCH, no_source_include=True)) is None


def test_pre_include_is_hashed(tree):
    opts = _opts(tree, pre_include="sub/c.h")
    src = 'extern "C" __global__ void k(int* out) { *out = C_VAL; }\n'
    before = header_digest(src, opts)
    _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 7\n")
    assert header_digest(src, opts) != before


def test_no_external_input_gives_none_so_keys_match_cuda_core():
    src = 'extern "C" __global__ void k(int* out) { *out = 1; }\n'
    assert header_digest(src, ProgramOptions(arch=ARCH)) is None
    # a builtin-only include (found on no path) adds nothing either
    assert header_digest("#include <cuda/std/cstdint>\n" + src, ProgramOptions(arch=ARCH)) is None


def test_nvvm_use_libdevice_is_keyed_by_the_libdevice_file():
    opts = ProgramOptions(arch="compute_90", use_libdevice=True)
    digest = header_digest(b"; nvvm ir", opts, "nvvm")
    assert isinstance(digest, bytes) and len(digest) == 32
    assert header_digest(b"; nvvm ir", ProgramOptions(arch="compute_90"), "nvvm") is None
    # the digest is what cuda-core asks for: it now builds the key
    make_program_cache_key(code=b"; nvvm ir", code_type="nvvm", options=opts, target_type="ptx", extra_digest=digest)


# -- the location-bound digest is unchanged; the portable one names roots, not places ----------


#: header_digest(SRC) over ``tree`` as the release before portable keys computed it (the
#: location-bound stream, which this tree leaves free of absolute paths).
LOCATION_BOUND_DIGEST = "68062d71a9648b20d72440d8c02492d1d1cc9e7eb9b8b9ad332bedf354747efc"


def test_the_location_bound_digest_is_the_one_made_before_portable_keys(tree):
    assert header_digest(SRC, _opts(tree)).hex() == LOCATION_BOUND_DIGEST
    assert header_digest(SRC, _opts(tree)).hex() == LOCATION_BOUND_DIGEST  # warm, from the memo
    assert header_scan(SRC, _opts(tree), portable=False).digest.hex() == LOCATION_BOUND_DIGEST
    assert header_scan(SRC, _opts(tree)).digest.hex() != LOCATION_BOUND_DIGEST  # the portable stream differs


def test_the_scan_records_each_file_read_by_root_and_relative_path(tree):
    scan = header_scan("#include <nowhere.h>\n" + SRC, _opts(tree))
    digest_of = {p: hashlib.sha256((tree / p).read_bytes()).hexdigest() for p in ("a.h", "sub/b.h", "sub/c.h")}
    assert scan.headers == tuple(HeaderFile("I0", p, digest_of[p]) for p in ("a.h", "sub/b.h", "sub/c.h"))
    assert scan.missing == ("nowhere.h",)
    assert scan.path_free


def test_the_source_directory_is_named_by_its_role(tmp_path, monkeypatch):
    """local.h (next to the source) includes "local2.h": the location-bound digest names the working
    directory by its absolute path; the portable one by ``source``, so two working directories agree."""
    digests = []
    for host in ("one", "two"):
        work = tmp_path / host / "deeper" / "work"
        _write(work / "local.h", '#include "local2.h"\n')
        _write(work / "local2.h", "#define VAL 1\n")
        monkeypatch.chdir(work)
        src = '#include "local.h"' + KERNEL
        scan = header_scan(src, ProgramOptions(arch=ARCH))
        assert [(h.root, h.path) for h in scan.headers] == [("source", "local.h"), ("source", "local2.h")]
        digests.append((scan.digest, header_digest(src, ProgramOptions(arch=ARCH))))
    assert digests[0][0] == digests[1][0]
    assert digests[0][1] != digests[1][1]


def test_an_absolute_spelling_under_a_root_is_named_relative_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scans = []
    for host in ("one", "two"):
        inc = tmp_path / host / "inc"
        _write(inc / "val.h", "#define VAL 1\n")
        scans.append(header_scan(KERNEL, ProgramOptions(arch=ARCH, include_path=[str(inc)],
                                                          pre_include=[str(inc / "val.h")])))
    assert scans[0].digest == scans[1].digest and scans[0].path_free
    assert scans[0].headers == (HeaderFile("I0", "val.h", scans[0].headers[0].digest),)


def test_a_file_under_no_root_keeps_its_absolute_path_and_says_so(tmp_path, monkeypatch):
    """inc/a.h includes "../outside/o.h": a ``..`` out of every root; and an absolute include outside."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    _write(tmp_path / "inc" / "a.h", '#include "../outside/o.h"\n')
    _write(tmp_path / "outside" / "o.h", "#define VAL 1\n")
    scan = header_scan('#include <a.h>' + KERNEL, _opts(tmp_path / "inc"))
    assert not scan.path_free
    assert ("abs", str(tmp_path / "outside" / "o.h")) in [(h.root, h.path) for h in scan.headers]
    absolute = header_scan(f'#include "{tmp_path / "outside" / "o.h"}"' + KERNEL, _opts(tmp_path / "inc"))
    assert not absolute.path_free
    (tmp_path / "inc" / "linked").symlink_to(tmp_path / "outside")  # a symlink out of the root
    assert not header_scan('#include <linked/o.h>' + KERNEL, _opts(tmp_path / "inc")).path_free
    both = ProgramOptions(arch=ARCH, include_path=[str(tmp_path / "inc"), str(tmp_path / "outside")])
    assert header_scan('#include <a.h>' + KERNEL, both).path_free  # its directory on the path: portable again


def test_a_computed_include_records_every_file_of_the_directories_it_could_reach(tree):
    _write(tree / "computed.h", "#define STR(x) #x\n#include STR(a.h)\n")
    scan = header_scan("#include <computed.h>" + KERNEL, _opts(tree))
    assert [h.path for h in scan.headers] == ["a.h", "computed.h", "sub/also_unrelated.h", "sub/b.h", "sub/c.h",
                                              "unrelated.h"]
    assert scan.path_free and scan.declined is None


# -- through the compile helper, with real NVRTC; paths as the OS resolves them ----------------


def test_compile_with_include_path_is_cached_and_a_header_edit_recompiles(tree):
    cache = InMemoryProgramCache()
    with pytest.raises(ValueError, match="extra_digest"):  # what cuda-core does on its own
        Program(SRC, "c++", _opts(tree)).compile("cubin", cache=cache)
    start = tpc.compile_count()
    first = tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    again = tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert tpc.compile_count() - start == 1
    assert bytes(again.code) == bytes(first.code)

    _write(tree / "unrelated.h", "#define NOT_USED 5\n")
    os.utime(tree / "a.h", (OLD + 1, OLD + 1))
    tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert tpc.compile_count() - start == 1  # unreachable edit and a touch: still a hit

    _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 40\n")
    edited = tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert tpc.compile_count() - start == 2
    assert bytes(edited.code) != bytes(first.code)


def test_dotdot_is_resolved_through_a_symlinked_directory_as_the_compiler_does(tmp_path, monkeypatch):
    """inc/sub -> real/sub; inc/sub/x.h says ``#include "../b.h"``: the compiler reads real/b.h, not inc/b.h."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "real" / "sub" / "x.h", '#include "../b.h"\n')
    _write(tmp_path / "real" / "b.h", "#define VAL 1\n")
    _write(tmp_path / "inc" / "b.h", "#define VAL 100\n")  # what a textual ``..`` would name
    (tmp_path / "inc" / "sub").symlink_to(tmp_path / "real" / "sub")
    src = '#include "sub/x.h"' + KERNEL
    opts = _opts(tmp_path / "inc")
    cache = InMemoryProgramCache()
    first = tpc.compile(src, "c++", opts, cache=cache)
    start = tpc.compile_count()
    _write(tmp_path / "real" / "b.h", "#define VAL 2\n", mtime=None)
    edited = tpc.compile(src, "c++", opts, cache=cache)
    assert tpc.compile_count() - start == 1
    assert bytes(edited.code) != bytes(first.code)


@pytest.mark.parametrize("odd", [
    "/* an unterminated comment\n#include \"val.h\"",
    '__device__ const char r[] = R"x(never closed\n#include "val.h"',
])
def test_what_the_scanner_cannot_read_in_the_main_source_declines_rather_than_walk_the_working_directory(valdir, odd):
    scan = header_scan(odd + KERNEL, _opts(valdir))
    assert scan.declined is not None and "working directory" in scan.declined
    assert scan.headers == ()  # nothing under the working directory (nor the include path) was read


def test_a_scan_bounded_by_files_read_answers_none_past_the_bound_and_memoizes_no_scan(tree):
    """``max_files``: the three files SRC reads fit a bound of 3, not one of 2; the bounded scan that stopped
    leaves no scan memoized (the next unbounded call scans), and one within the bound is the full scan."""
    from tiered_progcache.compiling import headerscan

    assert header_scan(SRC, _opts(tree), max_files=2) is None
    scans = headerscan.scans_run()
    full = header_scan(SRC, _opts(tree))
    assert headerscan.scans_run() == scans + 1 and len(full.headers) == 3
    assert header_scan(SRC, _opts(tree), max_files=3) == full
    assert header_scan(SRC, _opts(tree), max_files=2) == full  # memoized now: the memo answers first


def test_a_scan_that_reads_no_file_keys_the_names_it_missed_where_the_options_name_files(tmp_path):
    """No file read: the digest (of the names found nowhere) counts only where the options name files, or a decline."""
    empty = tmp_path / "empty"
    empty.mkdir()
    src = "#include <cuda_fp16.h>\n" + KERNEL
    with_path = header_scan(src, ProgramOptions(arch=ARCH, include_path=[str(empty)]))
    assert with_path.digest is not None and with_path.headers == () and with_path.missing == ("cuda_fp16.h",)
    assert with_path.path_free and with_path.declined is None and with_path.result is None
    assert not header_scan(src, ProgramOptions(arch=ARCH, include_path=[str(empty)]), portable=False).path_free
    without = header_scan(src, ProgramOptions(arch=ARCH))
    assert without.digest is None and without.missing == ("cuda_fp16.h",) and without.path_free
    big = empty / "big.h"
    big.touch()
    os.truncate(big, MAX_HEADER_BYTES + 1)  # sparse: never read, so the scan declines having read nothing
    declined = header_scan("#include <big.h>\n" + KERNEL, ProgramOptions(arch=ARCH, include_path=[str(empty)]))
    assert declined.declined == "found:I0: a header over 33554432 bytes"
    assert declined.digest is not None and declined.headers == ()
