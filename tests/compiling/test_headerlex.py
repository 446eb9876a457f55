"""The lexer (headerlex): every include spelling the compiler accepts is digested, text it does not read is
not, and computed includes resolve through the macros seen. Proved end to end: real files, real NVRTC."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from cuda.core import Program, ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache.compiling import headerlex
from tiered_progcache.compiling.headerscan import header_digest, header_scan

from header_support import KERNEL, fresh_header_memo, tree, valdir  # noqa: F401  (autouse, fixtures)
from header_support import include_opts as _opts
from header_support import write_header as _write

ARCH = "sm_90"


# -- every spelling the compiler accepts, and nothing it does not read -------------------------


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


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_include_spelling_the_compiler_accepts_is_digested(valdir, spelling):
    """Edit val.h and compile() compiles again, exactly once, and returns new bytes (real NVRTC)."""
    src = SPELLINGS[spelling] + KERNEL
    cache = InMemoryProgramCache()
    start = tpc.compile_count()
    first = tpc.compile(src, "c++", _opts(valdir), cache=cache)
    tpc.compile(src, "c++", _opts(valdir), cache=cache)
    assert tpc.compile_count() - start == 1
    _write(valdir / "val.h", "#define VAL 2\n", mtime=None)
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
    _write(tmp_path / "val.h", "#define VAL 2\n", mtime=None)
    edited = tpc.compile(src, "c++", ProgramOptions(arch=ARCH), cache=cache)
    assert tpc.compile_count() - start == 1
    assert bytes(edited.code) != bytes(first.code)


def test_includes_in_comments_and_strings_are_not_followed(valdir):
    src = '// #include "val.h"\n/* #include "val.h" */\n__device__ const char s[] = "#include \\"val.h\\"";\n'
    src += 'extern "C" __global__ void k(int* out) { *out = 1; }\n'
    before = header_digest(src, _opts(valdir))
    _write(valdir / "val.h", "#define VAL 3\n")
    assert header_digest(src, _opts(valdir)) == before


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


# -- computed includes, through the macros the lexer records -----------------------------------


def test_a_computed_include_through_a_define_reads_only_what_it_names(tree):
    scan = header_scan("#define HDR <a.h>\n#include HDR" + KERNEL, _opts(tree))
    assert [h.path for h in scan.headers] == ["a.h", "sub/b.h", "sub/c.h"]
    assert scan.path_free and scan.declined is None


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


# -- a property: any spelling built from what phases 1-3 allow is digested ---------------------


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


# -- the lexer's two token searches find the same tokens -----------------------------------------


def _tokens(pattern, text: bytes) -> list[tuple[int, int, str | None]]:
    """The tokens a search from the start finds, as the lexer walks them (each search from the last end)."""
    found, pos = [], 0
    while (m := pattern.search(text, pos)) is not None:
        found.append((m.start(), m.end(), m.lastgroup))
        pos = m.end()
    return found


#: Every byte the four letter- or digit-led tokens, and the tokens around them, are made of.
_LEX_ALPHABET = list(b"/*\"'#%:\\\n ()Rru8LU_hasincludeembedimportx0159.eEpP+-$\x80")


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(_LEX_ALPHABET), max_size=40).map(bytes))
def test_property_where_the_punctuation_search_is_taken_it_finds_every_token_the_full_one_does(text):
    """A text that needs every token (raw string, digit separator, ``__has_``, ``import`` possible) takes the
    full search; every other text finds exactly the same tokens with the fast one."""
    if not headerlex._needs_every_token(text):
        assert _tokens(headerlex._PUNCT_TOKEN_RE, text) == _tokens(headerlex._TOKEN_RE, text)


@pytest.mark.parametrize("text", [
    b'R"(a)"', b'x = u8R"d(a)d";', b'uR"(', b'UR"(', b'LR"(', b"1'000", b"0x1'F", b"1e+5'0", b".5'0", b"x2'a'",
    b"1e-x'y", b"0x1p+f'0", b"1E+x'y", b"0x1P-f'0", b'"BAR" R"(a)"', b'"BAR" R"(a)" "BAR"', b'R"(a)" "BAR"',
    b"__has_include(<a>)", b"import <a>;", b"  import m;",
])
def test_a_text_that_may_hold_a_letter_or_digit_led_token_takes_the_full_search(text):
    assert headerlex._needs_every_token(text)


@pytest.mark.parametrize("text", [
    b'"ERROR"', b'FOO_BAR"x"', b'xu8R"(', b'xLR"(', b"don't", b"important", b"reimport", b"'a' x'", b"a.b'c",
    b"e+'x", b"1e)'x", b"12+'x", b"1X+x'y", b'(xR"a"', b'(XR"a"', b"#include <a>\n// it's\n",
])
def test_a_text_that_cannot_hold_one_takes_the_fast_search(text):
    assert not headerlex._needs_every_token(text)
