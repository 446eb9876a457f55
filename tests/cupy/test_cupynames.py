"""cupynames and headerkeys' option parsing: names, frames, CuPy's file format, the user's -I directories.

Pure functions; no CuPy import (the command reads CuPy's directory without it).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from tiered_progcache.errors import EntryRejected
from tiered_progcache.cupy import cupynames
from tiered_progcache.cupy.cupynames import (
    FRAME_MAGIC,
    cache_key,
    check_name,
    decode_local,
    describe,
    encode_local,
    frame,
    header_name,
    is_name,
    name_of,
    opened,
    unframe,
)
from tiered_progcache.cupy.headerkeys import user_header_options
from tiered_progcache.stores.store import entry_name

NAME = "0123456789abcdef0123456789abcdef01234567.cubin"


@pytest.mark.parametrize("name", [NAME, "f" * 40 + ".ltoir", "a" * 40 + "-h" + "b" * 40 + ".cubin", "a" * 40 + "." + "x" * 16])
def test_cupy_s_names_and_ours_are_names(name):
    assert is_name(name) and check_name(name) == name


@pytest.mark.parametrize("name", ["", "a" * 39 + ".cubin", "a" * 41 + ".cubin", "A" * 40 + ".cubin", "a" * 40,
                                  "a" * 40 + ".", "a" * 40 + "." + "x" * 17, "a" * 40 + ".cu/bin", "../" + NAME,
                                  NAME + "\n", "a" * 40 + "-h" + "b" * 39 + ".cubin", "a" * 40 + ".CUBIN"])  # fmt: skip
def test_anything_else_is_not_a_name_and_is_refused_with_the_form_expected(name):
    assert not is_name(name)
    with pytest.raises(ValueError, match=r"not a CuPy cache name \(40 hex digits and an extension"):
        check_name(name)


def test_a_name_that_is_not_a_str_is_a_type_error():
    assert not is_name(b"x")
    with pytest.raises(TypeError, match="a CuPy cache name must be a str, got bytes"):
        check_name(NAME.encode())


def test_keys_and_entry_names_are_their_own_namespace():
    assert cupynames.NAMESPACE == "cupy" and cupynames.KEY_PREFIX == "cupy/"
    assert cache_key(NAME) == b"cupy/" + NAME.encode()
    assert name_of(NAME) == entry_name(b"cupy/" + NAME.encode()) == hashlib.sha256(b"cupy/" + NAME.encode()).hexdigest()


def test_a_header_name_keeps_cupy_s_stem_and_extension_and_depends_on_both():
    named = header_name(NAME, b"digest")
    stem = NAME.split(".")[0]
    expected = hashlib.sha1(b"tiered-progcache/cupy-header-name/1\0" + stem.encode() + b"\0digest").hexdigest()
    assert named == f"{stem}-h{expected}.cubin" and is_name(named)
    assert header_name(NAME, b"other") != named
    assert header_name("f" * 40 + ".cubin", b"digest") != named
    assert header_name(NAME.replace(".cubin", ".ltoir"), b"digest").endswith(".ltoir")
    with pytest.raises(ValueError, match="already a header-keyed name"):
        header_name(named, b"digest")


def test_the_local_format_is_the_sha1_hex_then_the_payload():
    payload = b"\x7fELF" + bytes(range(256))
    assert encode_local(payload) == hashlib.sha1(payload).hexdigest().encode() + payload
    assert decode_local(encode_local(payload)) == payload
    assert decode_local(encode_local(b"")) == b""
    assert decode_local(b"0" * 39) is None
    bad = bytearray(encode_local(payload))
    bad[-1] ^= 1
    assert decode_local(bytes(bad)) is None
    assert decode_local(encode_local(payload).upper()) is None  # CuPy's hex is lower case


def test_a_frame_names_its_entry_and_opens_only_as_that_entry():
    payload = b"\x93CUPYNE\x00" + b"names and cubin"
    stored = frame(NAME, payload)
    assert stored == FRAME_MAGIC + json.dumps({"name": NAME}).encode() + b"\n" + payload
    assert unframe(stored) == (NAME, payload) and describe(stored) == NAME
    assert opened(stored, NAME) == payload
    other = "f" * 40 + ".cubin"
    with pytest.raises(EntryRejected, match=f"entry holds cupy/{NAME}, not cupy/{other}"):
        opened(stored, other)
    with pytest.raises(EntryRejected) as refused:
        opened(payload, NAME)
    assert refused.value.args == (f"not a CuPy entry (no TPCCUPY1 frame): cupy/{NAME}",)


@pytest.mark.parametrize("stored", [
    b"", b"TPCTRITON1\n{}\n", FRAME_MAGIC, FRAME_MAGIC + b'{"name": "x"}\n', FRAME_MAGIC + b"not json\n",
    FRAME_MAGIC + b'["' + NAME.encode() + b'"]\n', FRAME_MAGIC + b'{"file": "' + NAME.encode() + b'"}\n',
    FRAME_MAGIC + b'{"name": "' + NAME.encode() + b'"' + b" " * 300 + b"}\n",  # past the bounded first line
])  # fmt: skip
def test_what_is_not_a_cupy_frame_describes_as_none(stored):
    assert unframe(stored) is None and describe(stored) is None


def test_a_frame_line_within_its_bound_is_read():
    padded = FRAME_MAGIC + b'{"name": "' + NAME.encode() + b'"' + b" " * 180 + b"}\npayload"
    assert unframe(padded) == (NAME, b"payload")


def test_a_frame_is_only_made_for_a_name():
    with pytest.raises(ValueError):
        frame("../x", b"")


OWN = ("/site/cupy/_core/include", "/usr/local/cuda/include")


@pytest.mark.parametrize("options, dirs", [
    (("-I/inc",), ["/inc"]),
    (("-I", "/inc"), ["/inc"]),
    (("-I=/inc",), ["/inc"]),
    (("--include-path=/inc",), ["/inc"]),
    (("--include-path", "/inc"), ["/inc"]),
    (("-I/a", "-I/site/cupy/_core/include", "-I/usr/local/cuda/include/", "-I/b"), ["/a", "/b"]),
    (("--std=c++17", "-DX=1", "-ftz=true"), []),
    (("-I",), []),  # a dangling flag names nothing
])  # fmt: skip
def test_the_user_s_include_directories_in_every_spelling_cupy_s_own_left_out(options, dirs):
    assert user_header_options(options, OWN)[0] == dirs


def test_macros_and_pre_includes_are_read_as_nvrtc_reads_them():
    dirs, pre, macros = user_header_options(
        ("-DA=1", "-D", "B", "--define-macro=C=x=y", "--define-macro", "D", "-include", "p.h", "--pre-include=q.h",
         "-includeX"), OWN)  # fmt: skip
    assert dirs == [] and pre == ["p.h", "q.h"]
    assert macros == [("A", "1"), "B", ("C", "x=y"), "D"]
