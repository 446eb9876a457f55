"""A truncated or mangled local code object is a counted miss, removed, and compiled again (issue 19 item 9).

Real NVRTC output throughout: a cubin, PTX, and a fatbin nvfatbin builds from them.
"""

from __future__ import annotations

import functools
import struct

import pytest
from cuda.bindings import nvrtc
from cuda.core import Program, ProgramOptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered_progcache
from tiered_progcache import LocalDir, TieredProgramCache
from tiered_progcache.stores.codeobject import check_code_object

SRC = 'extern "C" __global__ void k(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] = 2.0f * x[i] + 1.0f; }\n'
OPTS = ProgramOptions(arch="sm_80")
_SHT_NOBITS = 8


@functools.lru_cache(maxsize=None)
def cubin() -> bytes:
    return bytes(Program(SRC, "c++", OPTS).compile("cubin").code)


@functools.lru_cache(maxsize=None)
def ptx() -> bytes:
    """NVRTC's PTX, NUL and all (cuda-core's PTX path needs a driver; nvrtc itself does not)."""
    err, prog = nvrtc.nvrtcCreateProgram(SRC.encode(), b"k.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"-arch=compute_80"])
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        out = b" " * size
        nvrtc.nvrtcGetPTX(prog, out)
        return bytes(out)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@functools.lru_cache(maxsize=None)
def fatbin() -> bytes:
    nvfatbin = pytest.importorskip("cuda.bindings.nvfatbin")
    try:
        handle = nvfatbin.create([], 0)
    except Exception as exc:  # cuda-bindings without the nvidia-nvfatbin library
        pytest.skip(f"nvfatbin is not usable here: {exc!r}")
    try:
        nvfatbin.add_cubin(handle, cubin(), len(cubin()), "80", "k")
        nvfatbin.add_ptx(handle, ptx(), len(ptx()), "80", "k", "")
        out = bytearray(nvfatbin.size(handle))
        nvfatbin.get(handle, out)
        return bytes(out)
    finally:
        nvfatbin.destroy(handle)


def _sections(elf: bytes) -> list[tuple[int, int, int, int]]:
    """(header offset, sh_type, sh_offset, sh_size) of each section of a cubin."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    (shnum,) = struct.unpack_from("<H", elf, 0x3C)
    out = []
    for i in range(shnum):
        at = shoff + i * 64
        sh_type, = struct.unpack_from("<I", elf, at + 4)
        offset, size = struct.unpack_from("<QQ", elf, at + 24)
        out.append((at, sh_type, offset, size))
    return out


def test_whole_real_code_objects_pass():
    assert check_code_object(cubin()) is None
    assert check_code_object(ptx()) is None and check_code_object(ptx().rstrip(b"\0")) is None
    assert check_code_object(b"bytes of no known format", unknown_ok=True) is None  # what the local read passes


def test_a_whole_real_fatbin_passes():
    assert check_code_object(fatbin()) is None


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(min_value=1, max_value=10**6))
def test_a_cubin_cut_anywhere_fails_the_check(cut):
    data = cubin()
    assert check_code_object(data[: cut % len(data)] or data[:1], unknown_ok=True) is not None


def test_every_cut_of_a_cubin_and_of_a_fatbin_fails():
    for whole in (cubin(), fatbin()):
        assert [n for n in range(1, len(whole)) if check_code_object(whole[:n], unknown_ok=True) is None] == []


def test_ptx_cut_anywhere_inside_its_text_fails():
    text_end = len(ptx().rstrip(b"\0 \t\r\n"))
    assert [n for n in range(1, text_end) if check_code_object(ptx()[:n], unknown_ok=True) is None] == []


def test_flipped_section_table_bytes_fail_the_check():
    data = cubin()
    sections = [s for s in _sections(data) if s[1] not in (0, _SHT_NOBITS) and s[3] > 0]
    assert len(sections) >= 5
    for at, _, offset, size in sections:
        grown = bytearray(data)
        struct.pack_into("<Q", grown, at + 32, len(data) - offset + 1)  # sh_size one past the end of the file
        assert "a section reaches" in check_code_object(bytes(grown))
        moved = bytearray(data)
        moved[at + 24 + 7] ^= 0x80  # the top byte of sh_offset
        assert check_code_object(bytes(moved)) is not None
    header = bytearray(data)
    header[0x3C] ^= 0xFF  # e_shnum: the table now reaches past the end
    assert check_code_object(bytes(header)) is not None
    entsize = bytearray(data)
    entsize[0x3A] = 40  # e_shentsize
    assert "not a sane ELF64 header" in check_code_object(bytes(entsize))


def test_a_fatbin_whose_entry_sizes_do_not_add_up_fails():
    data = bytearray(fatbin())
    (header_size,) = struct.unpack_from("<H", data, 6)
    struct.pack_into("<Q", data, header_size + 8, struct.unpack_from("<Q", data, header_size + 8)[0] + 1)
    assert "an entry at byte" in check_code_object(bytes(data))


def _chain(root) -> TieredProgramCache:
    return TieredProgramCache(root)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=1, max_value=10**6))
def test_a_truncated_local_cubin_is_a_counted_miss_and_removed(tmp_path_factory, cut):
    root = tmp_path_factory.mktemp("local")
    key = b"a kernel"
    with _chain(root) as first:
        first[key] = cubin()
    path = LocalDir(root).path_for(tiered_progcache.stores.store.entry_name(key))
    whole = path.read_bytes()
    path.write_bytes(whole[: cut % len(whole)] or whole[:1])
    with _chain(root) as cache:  # a new process: the memory tier is cold
        assert cache.get(key) is None
        local = cache.stats()["local"]
        assert (local.hits, local.misses, local.rejected, local.errors) == (0, 1, 1, 0)
    assert not path.exists()  # removed, as verify --delete-bad would


def test_a_corrupt_entry_is_removed_only_if_no_writer_replaced_it_since_it_was_read(tmp_path):
    """cuda-core's stat guard: the file read is removed, a whole entry renamed in since is kept."""
    import os

    from tiered_progcache.stores.localdir import _remove_if_unchanged

    local = LocalDir(tmp_path)
    name = tiered_progcache.stores.store.entry_name(b"k")
    local.write_entry(name, cubin()[:100])
    path = local.path_for(name)
    read = os.stat(path)  # what read_key saw (fstat of its descriptor)
    local.write_entry(name, cubin())  # a writer renames a whole entry in before the removal
    assert _remove_if_unchanged(str(path), read) is False and path.read_bytes() == cubin()
    assert local.read_key(b"k") == cubin()
    local.write_entry(name, cubin()[:100])
    assert _remove_if_unchanged(str(path), os.stat(path)) is True and not path.exists()


@pytest.mark.parametrize("cut", [1, 63, 64, 1000, -700, -1])
def test_compile_recompiles_once_and_never_returns_the_truncated_bytes(tmp_path, events, cut):
    with _chain(tmp_path) as cache:
        first = bytes(tiered_progcache.compile(SRC, "c++", OPTS, cache=cache).code)
    assert len(events) == 1
    stored = [p for p in (tmp_path / "entries").rglob("*") if p.is_file() and p.read_bytes() == first]
    assert len(stored) == 1
    stored[0].write_bytes(first[:cut])
    with _chain(tmp_path) as cache:  # a new process: the memory tier is cold
        again = bytes(tiered_progcache.compile(SRC, "c++", OPTS, cache=cache).code)
        assert cache.stats()["local"].rejected == 1
        assert bytes(tiered_progcache.compile(SRC, "c++", OPTS, cache=cache).code) == first  # a memory hit now
    assert again == first and len(events) == 2  # exactly one more NVRTC run
    assert stored[0].read_bytes() == first  # the entry is whole again
    with _chain(tmp_path) as cache:
        assert bytes(tiered_progcache.compile(SRC, "c++", OPTS, cache=cache).code) == first
        assert (cache.stats()["local"].hits, cache.stats()["local"].rejected) == (1, 0)
    assert len(events) == 2


_SYMBOLS = b'{"format": "tiered-progcache/symbols", "symbols": [], "version": 1}'
_PTX = b"//\n// Generated by NVIDIA NVVM Compiler\n.version 9.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n\0"


@pytest.mark.parametrize(("data", "unknown_ok", "why"), [
    (b"", True, "empty"),
    (b"\x7fEL", True, "truncated (3 bytes: the start of a code object's magic)"),
    (b"\x50\xed", True, "truncated (2 bytes: the start of a code object's magic)"),
    (b"\xedCN\x7f" + bytes(12), False, None),  # LTO-IR: its magic only
    (b"\xedcn\x7f" + bytes(12), False, "not a cubin, fatbin, LTO-IR or PTX (unknown format)"),
    (_SYMBOLS, False, None),
    (_SYMBOLS[:-1], True, "not a whole JSON document (a symbol map or manifest cut short?)"),
    (b'{"format": "tiered-progcache/other"}', False, "a JSON document of no format stored here"),
    (b'{"format": "tiered-progcache/other"}', True, None),
    (b'{"name": "tiered-progcache/symbols"}', False, "a JSON document of no format stored here"),
    (b'{"FORMAT": "tiered-progcache/symbols"}', False, "a JSON document of no format stored here"),
    (b'{"kind": "x"}', False, "not a cubin, fatbin, LTO-IR or PTX (unknown format)"),  # not ours: not parsed
    (b' {"format": "tiered-progcache/symbols"', True, None),  # does not start as our documents do
    (_PTX, False, None),
    (_PTX[:40], True, "not whole PTX (cut short before its .target)"),
    (_PTX.replace(b".version 9.0\n", b""), True, "not whole PTX (cut short before its .target)"),
    (_PTX[:-6], True, "not whole PTX (cut short: it ends inside a statement)"),
    (b"\x7fELF", True, "truncated or not a 64-bit little-endian ELF"),  # a whole magic: the ELF check says
    (b".version 9.0\n.target sm_90\n.extern .func f();\n", True, None),  # PTX may end in ';'
    (b".version 9.0\n.target sm_90\n{\n{ ret; }\n", True, "not whole PTX (cut short: its braces do not balance)"),
    (b'.version 9.0\n.target sm_90\n.file 1 "a{.cu"\n{ ret; }\n', True, None),  # a quoted name may hold a brace
    (b".version 9.0\n.target sm_90\n\0{ ret; }", False, "not a cubin, fatbin, LTO-IR or PTX (unknown format)"),
    (b".version 9.0\n.target sm_90\n{ ret; }\0XX", False, "not a cubin, fatbin, LTO-IR or PTX (unknown format)"),
    (b"plain text, no format", False, "not a cubin, fatbin, LTO-IR or PTX (unknown format)"),
    (b"plain text, no format", True, None),
    (b"text\0with a NUL", False, "not a cubin, fatbin, LTO-IR or PTX (unknown format)"),
])  # fmt: skip
def test_each_format_s_verdict_and_reason_exactly(data, unknown_ok, why):
    """What the local read and push are told about bytes of each kind, word for word (mutmut's survivors)."""
    assert check_code_object(data, unknown_ok=unknown_ok) == why
    if not unknown_ok:
        assert check_code_object(data) == why  # strict unless asked


def _elf(sections=((1, 0, None),), segments=((0, None),), *, ident=(2, 1), ehsize=64, shstrndx=0):
    """A synthetic ELF64: header, program headers, section headers, nothing after; a None size reaches the end."""
    header = bytearray(64)
    header[:7] = b"\x7fELF" + bytes([ident[0], ident[1], 0])  # EI_VERSION 0: only bytes 4 and 5 are checked
    phoff, shoff = 64, 64 + 56 * len(segments)
    size = shoff + 64 * len(sections)
    struct.pack_into("<QQIHHHHHH", header, 0x20, phoff, shoff, 0, ehsize, 56, len(segments), 64, len(sections), shstrndx)
    segs = b"".join(struct.pack("<8xQ16xQ16x", off, size - off if n is None else n) for off, n in segments)
    secs = b"".join(struct.pack("<4xI16xQQ24x", t, off, size - off if n is None else n) for t, off, n in sections)
    return bytes(header) + segs + secs


@pytest.mark.parametrize(("data", "why"), [
    (_elf(), None),  # every table and section ends exactly at the end of the file
    (_elf(sections=(), segments=()), None),  # a 64-byte header alone
    (_elf()[:63], "truncated or not a 64-bit little-endian ELF"),
    (_elf(ident=(2, 2)), "truncated or not a 64-bit little-endian ELF"),
    (_elf(ident=(1, 1)), "truncated or not a 64-bit little-endian ELF"),
    (_elf(ehsize=63), "not a sane ELF64 header (header or table entry sizes)"),
    (_elf()[:-1], "truncated ELF (183 bytes; its header tables reach past the end)"),
    (_elf(sections=((1, 0, None), (1, 0, None)), shstrndx=1), None),
    (_elf(sections=((1, 0, None), (1, 0, None)), shstrndx=2), "not a sane ELF64 header (section name table index)"),
    (_elf(sections=((1, 10, 239),)), "truncated ELF (184 bytes; a section reaches byte 249)"),
    (_elf(sections=((8, 10, 239),)), None),  # SHT_NOBITS holds no bytes in the file
    (_elf(segments=((10, 175),)), "truncated ELF (184 bytes; a segment reaches byte 185)"),
])  # fmt: skip
def test_an_elf_s_tables_and_sections_must_lie_within_the_file_to_the_byte(data, why):
    """The ELF checks at their edges, word for word: what ends at the last byte is whole, one byte past is cut."""
    assert check_code_object(data) == why


def _fatbin(entries=((1, 16, 8),), *, padding=0, header_size=16, body_extra=0):
    """A synthetic fatbin: its header, then each (kind, entry header size, payload size) entry, then zero padding."""
    body = b"".join(struct.pack("<HHIQ", kind, 1, hdr, n) + bytes(max(0, hdr - 16) + n) for kind, hdr, n in entries)
    body += bytes(padding)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, header_size, len(body) + body_extra) + body


@pytest.mark.parametrize(("data", "why"), [
    (_fatbin(), None),
    (_fatbin(entries=()), None),  # a header alone, an empty body
    (_fatbin()[:15], "truncated fatbin"),
    (_fatbin(body_extra=1), "truncated fatbin (40 bytes of 41)"),
    (_fatbin(header_size=15), "truncated fatbin (40 bytes of 39)"),
    (_fatbin(body_extra=-1), "not a whole fatbin (an entry at byte 16 reaches past its body, which ends at 39)"),
    (_fatbin(entries=((1, 15, 9),)), "not a whole fatbin (an entry at byte 16 reaches past its body, which ends at 41)"),
    (_fatbin(entries=((1, 8, 0),)), "not a whole fatbin (an entry at byte 16 reaches past its body, which ends at 32)"),
    (_fatbin(entries=((1, 16, 8), (1, 8, 0))), "not a whole fatbin (an entry at byte 40 reaches past its body, which ends at 56)"),
    (_fatbin(padding=16), None),  # zero padding after the last entry
    (_fatbin(entries=((1, 16, 8), (0, 16, 0))), None),  # a kind-0 entry that is whole is walked, not padding
    (_fatbin(entries=((1, 16, 8), (0, 16, 8)), body_extra=-1), "not a whole fatbin (an entry at byte 40 reaches past its body, which ends at 63)"),
    (_fatbin(entries=((1, 16, 8), (1, 0, 0))), "not a whole fatbin (an entry at byte 40 reaches past its body, which ends at 56)"),
])  # fmt: skip
def test_a_fatbin_s_entries_must_tile_its_body_to_the_byte(data, why):
    """The fatbin checks at their edges, word for word; zero padding after the last entry is allowed."""
    assert check_code_object(data) == why
