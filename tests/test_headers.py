"""Header digests: which file changes change the key, which do not, and what the memo saves."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from cuda.core import Program, ProgramOptions
from cuda.core.utils import InMemoryProgramCache, make_program_cache_key

import tiered_progcache as tpc
from tiered_progcache import headers
from tiered_progcache.headers import HeaderFile, header_digest, header_scan, needs_header_digest

from header_support import fresh_header_memo  # noqa: F401  (autouse)
from support import options as _opts

ARCH = "sm_90"
OLD = time.time() - 3600  # mtimes an hour back: old enough for the memo to trust a stat


def _write(path: Path, text: str, *, settled: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if settled:
        os.utime(path, (OLD, OLD))
    return path


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """inc/ with a reachable chain (a.h -> sub/b.h -> c.h by quoted-relative include) and bystanders."""
    inc = tmp_path / "inc"
    _write(inc / "a.h", '#pragma once\n#include "sub/b.h"\n#define A_VAL (B_VAL + 1)\n')
    _write(inc / "sub" / "b.h", '#pragma once\n#include "c.h"\n#define B_VAL (C_VAL * 2)\n')
    _write(inc / "sub" / "c.h", "#pragma once\n#define C_VAL 3\n")
    _write(inc / "unrelated.h", "#define NOT_USED 1\n")
    _write(inc / "sub" / "also_unrelated.h", "#define ALSO_NOT_USED 1\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the source's own directory is the working directory
    return inc


SRC = '#include <a.h>\nextern "C" __global__ void k(int* out) { *out = A_VAL; }\n'


# -- what changes the digest -----------------------------------------------------------------


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


def test_touching_without_change_keeps_the_digest_and_rehashes_only_that_file(tree):
    before = header_digest(SRC, _opts(tree))
    hashed = headers.files_hashed()
    os.utime(tree / "sub" / "b.h", (OLD + 60, OLD + 60))
    assert header_digest(SRC, _opts(tree)) == before
    assert headers.files_hashed() - hashed == 1


def test_a_warm_memo_hashes_nothing(tree):
    header_digest(SRC, _opts(tree))
    hashed = headers.files_hashed()
    for _ in range(50):
        header_digest(SRC, _opts(tree))
    assert headers.files_hashed() == hashed
    headers.clear_memo()
    header_digest(SRC, _opts(tree))
    assert headers.files_hashed() - hashed == 3  # a.h, b.h, c.h: the reachable ones only


def test_a_freshly_written_header_is_rehashed_until_it_settles(tree):
    """Two edits inside one coarse clock tick can leave size, mtime and ctime alike, so a
    stat cannot vouch for a header modified in the last RACY_NS: it is read every time."""
    _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 5\n", settled=False)
    first = header_digest(SRC, _opts(tree))
    hashed = headers.files_hashed()
    assert header_digest(SRC, _opts(tree)) == first
    assert headers.files_hashed() - hashed == 1  # c.h, read again; a.h and b.h trusted
    os.utime(tree / "sub" / "c.h", (OLD, OLD))  # settled now
    header_digest(SRC, _opts(tree))
    hashed = headers.files_hashed()
    header_digest(SRC, _opts(tree))
    assert headers.files_hashed() == hashed


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


def test_recheck_window_trusts_a_scan_for_that_long(tree):
    before = header_digest(SRC, _opts(tree), recheck_s=3600)
    _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 8\n")
    assert header_digest(SRC, _opts(tree), recheck_s=3600) == before  # trusted, as asked
    assert header_digest(SRC, _opts(tree)) != before  # recheck_s=0 looks again


# -- the location-bound digest is unchanged; the portable one names roots, not places ---------------

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


def test_a_warm_scan_returns_the_files_without_reading_any(tree):
    first = header_scan(SRC, _opts(tree))
    hashed = headers.files_hashed()
    again = header_scan(SRC, _opts(tree))
    assert headers.files_hashed() == hashed
    assert again.headers is first.headers  # the memoized tuple, not a rebuilt one


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


def test_a_computed_include_through_a_define_reads_only_what_it_names(tree):
    scan = header_scan("#define HDR <a.h>\n#include HDR" + KERNEL, _opts(tree))
    assert [h.path for h in scan.headers] == ["a.h", "sub/b.h", "sub/c.h"]
    assert scan.path_free and scan.declined is None


# -- through the compile helper, with real NVRTC ---------------------------------------------------


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


# -- every spelling the compiler accepts, and paths as the OS resolves them ------------------------

KERNEL = '\nextern "C" __global__ void k(int* out) { *out = VAL; }\n'

#: Include directives as the compiler reads them after translation phases 1-3 (splices
#: removed, comments one space, ``%:`` is ``#``): each one really includes val.h.
SPELLINGS = {
    "comment-before-name": '#include /* c */ "val.h"',
    "splice-in-directive": '#inc\\\nlude "val.h"',
    "splice-in-header-name": '#include "va\\\nl.h"',
    "splice-after-hash-crlf": '#\\\r\ninclude "val.h"',
    "digraph": '%:include "val.h"',
    "comment-after-hash": "# /**/ include \"val.h\"",
    "multiline-comment-before-hash": '/* a\n   b */ #include "val.h"',
    "multiline-comment-after-hash": '#/*\n*/include "val.h"',
    "angle-no-space": "#include<val.h>",
    "after-a-string-with-a-comment-opener": '__device__ const char s[] = "/*";\n#include "val.h"',
    "after-a-raw-string": '__device__ const char r[] = R"x(*/ /*)x";\n#include "val.h"',
    "after-digit-separators": "__device__ const int n = 1'000'000; /* ' */\n#include \"val.h\"",
}


@pytest.fixture
def valdir(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    _write(inc / "val.h", "#define VAL 1\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return inc


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_include_spelling_the_compiler_accepts_is_digested(valdir, spelling):
    """Edit val.h and compile() compiles again, exactly once, and returns new bytes (real NVRTC)."""
    src = SPELLINGS[spelling] + KERNEL
    cache = InMemoryProgramCache()
    start = tpc.compile_count()
    first = tpc.compile(src, "c++", _opts(valdir), cache=cache)
    tpc.compile(src, "c++", _opts(valdir), cache=cache)
    assert tpc.compile_count() - start == 1
    _write(valdir / "val.h", "#define VAL 2\n", settled=False)
    edited = tpc.compile(src, "c++", _opts(valdir), cache=cache)
    assert tpc.compile_count() - start == 2
    assert bytes(edited.code) != bytes(first.code)


def test_a_spliced_include_without_include_path_is_not_taken_for_a_plain_compile(tmp_path, monkeypatch):
    """No include path and no literal "include" in the source: the fast path must still see the splice."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "val.h", "#define VAL 1\n")
    src = '#inc\\\nlude "val.h"' + KERNEL
    cache = InMemoryProgramCache()
    first = tpc.compile(src, "c++", ProgramOptions(arch=ARCH), cache=cache)
    start = tpc.compile_count()
    _write(tmp_path / "val.h", "#define VAL 2\n", settled=False)
    edited = tpc.compile(src, "c++", ProgramOptions(arch=ARCH), cache=cache)
    assert tpc.compile_count() - start == 1
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
    _write(tmp_path / "real" / "b.h", "#define VAL 2\n", settled=False)
    edited = tpc.compile(src, "c++", opts, cache=cache)
    assert tpc.compile_count() - start == 1
    assert bytes(edited.code) != bytes(first.code)


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


@pytest.mark.parametrize("odd", [
    "/* an unterminated comment\n#include \"val.h\"",
    '__device__ const char r[] = R"x(never closed\n#include "val.h"',
])
def test_what_the_scanner_cannot_read_falls_back_to_the_whole_include_directories(valdir, odd):
    _write(valdir / "odd.h", odd + "\n")  # in a header of the include path: its directory is walked whole
    src = "#include <odd.h>" + KERNEL
    before = header_digest(src, _opts(valdir))
    _write(valdir / "unrelated_new.h", "#define X 1\n")  # a file reachable only through the fallback
    assert header_digest(src, _opts(valdir)) != before
    assert header_scan(src, _opts(valdir)).declined is None


@pytest.mark.parametrize("odd", [
    "/* an unterminated comment\n#include \"val.h\"",
    '__device__ const char r[] = R"x(never closed\n#include "val.h"',
])
def test_what_the_scanner_cannot_read_in_the_main_source_declines_rather_than_walk_the_working_directory(valdir, odd):
    scan = header_scan(odd + KERNEL, _opts(valdir))
    assert scan.declined is not None and "working directory" in scan.declined
    assert scan.headers == ()  # nothing under the working directory (nor the include path) was read


@pytest.mark.parametrize("odd", [
    "#define HDR <val.h>\n#include HDR",
    "#define H(x) __has_include(x)\n#if H(<val.h>)\n#endif",
    "#define H(x) __has_include(x)\n#define W(y) H(y)\n#define HDR <val.h>\n#if W(HDR)\n#endif",
])
def test_a_computed_include_or_has_include_through_macros_reads_exactly_what_it_names(valdir, odd):
    before = header_digest(odd + KERNEL, _opts(valdir))
    scan = header_scan(odd + KERNEL, _opts(valdir))
    assert [h.path for h in scan.headers] == ["val.h"] and scan.declined is None
    _write(valdir / "unrelated_new.h", "#define X 1\n")  # not nameable by it: no effect
    assert header_digest(odd + KERNEL, _opts(valdir)) == before
    _write(valdir / "val.h", "#define VAL 4\n")
    assert header_digest(odd + KERNEL, _opts(valdir)) != before


def test_includes_in_comments_and_strings_are_not_followed(valdir):
    src = '// #include "val.h"\n/* #include "val.h" */\n__device__ const char s[] = "#include \\"val.h\\"";\n'
    src += 'extern "C" __global__ void k(int* out) { *out = 1; }\n'
    before = header_digest(src, _opts(valdir))
    _write(valdir / "val.h", "#define VAL 3\n")
    assert header_digest(src, _opts(valdir)) == before


# -- a property: any spelling built from what phases 1-3 allow is digested ---------------------------

_GAPS = st.lists(st.sampled_from([" ", "\t", "/**/", "/* c */", "/*\n*/", "\\\n", "\\\r\n", "\f"]), max_size=3).map("".join)


def _splice_into(word: str, at: int) -> str:
    at %= len(word) + 1
    return word[:at] + "\\\n" + word[at:]


@st.composite
def include_spellings(draw) -> str:
    lead = draw(st.sampled_from(["", " ", "\t", "/* c */ ", "/* two\nlines */ "]))
    hash_ = draw(st.sampled_from(["#", "%:", "#\\\n", "%\\\n:"]))
    name = draw(st.sampled_from(["include", "include_next"]))
    if draw(st.booleans()):
        name = _splice_into(name, draw(st.integers(0, 20)))
    header = draw(st.sampled_from(['"val.h"', "<val.h>"]))
    if draw(st.booleans()):
        header = _splice_into(header, draw(st.integers(0, 20)))
    tail = draw(st.sampled_from(["", " // c", " /* c */", " /* c\n c */"]))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    before = draw(st.sampled_from([
        "", "// #include \"other.h\"\n", '__device__ const char s[] = "/*";\n', "__device__ const int n = 1'000;\n",
        '__device__ const char r[] = R"(/*)";\n', "/* c */\n",
    ]))
    return before + lead + hash_ + draw(_GAPS) + name + draw(_GAPS) + header + tail + newline


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spelling=include_spellings())
def test_property_the_digest_follows_the_included_header_whatever_the_spelling(valdir, spelling):
    src = spelling + KERNEL
    _write(valdir / "val.h", "#define VAL 1\n")
    one = header_digest(src, _opts(valdir))
    _write(valdir / "val.h", "#define VAL 22\n")
    assert header_digest(src, _opts(valdir)) != one


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spelling=include_spellings())
def test_property_nvrtc_agrees_that_each_generated_spelling_includes_the_header(valdir, spelling):
    """The oracle for the property above: NVRTC's output does change with val.h for these spellings."""
    src = spelling + KERNEL
    out = []
    for val in (1, 22):
        _write(valdir / "val.h", f"#define VAL {val}\n")
        out.append(bytes(Program(src, "c++", _opts(valdir)).compile("cubin").code))
    assert out[0] != out[1]


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
    dirs = [base, f"{base}/a", f"{base}/a/b", f"{tmp_path}/via/a/b", f"{base}/a/here", f"{base}/a/here/b",
            f"{base}/a/loop", f"{base}/a/loop/x", f"{base}/a/up/a", f"{base}/missing/x", f"{base}/a/../a/b",
            f"{base}/a/./b", "/" + f"{base}/a", f"{base}/a/b/"]
    pairs = []
    for d in dirs:
        for recorded in {d, os.path.realpath(d), f"{base}/a/b"}:
            assert headers._same_realpaths(((d, recorded),)) == (os.path.realpath(d) == recorded), (d, recorded)
            pairs.append((d, recorded))
    good = tuple((d, r) for d, r in pairs if os.path.realpath(d) == r)
    assert headers._same_realpaths(good)
    for bad in [(d, r) for d, r in pairs if os.path.realpath(d) != r]:
        assert not headers._same_realpaths((*good, bad))  # a shared component seen earlier never hides it
    # the common case turned bad: an ancestor swapped for a symlink to an identical copy
    (tmp_path / "copy" / "a" / "b").mkdir(parents=True)
    recorded = ((f"{base}/a/b", f"{base}/a/b"), (f"{base}/a", f"{base}/a"))
    assert headers._same_realpaths(recorded)
    os.rename(real / "a", tmp_path / "old-a")
    (real / "a").symlink_to(tmp_path / "copy" / "a")
    assert not headers._same_realpaths(recorded)
