"""Framing checks for the code objects a local directory holds (cubin, fatbin, LTO-IR, PTX).

Beside them it holds the small JSON documents ``compile()`` stores (symbol maps and
manifests): whole ones of a format of ours pass, cut-short ones fail.
"""

from __future__ import annotations

import json
import re
import struct

#: The ``format`` of every JSON document stored as an entry (``symbols.SYMBOLS_FORMAT``, ``manifest.MANIFEST_FORMAT``).
DOCUMENT_FORMATS = frozenset({"tiered-progcache/symbols", "tiered-progcache/manifest"})

__all__ = ["check_code_object", "code_arch"]


def check_code_object(data: bytes, *, unknown_ok: bool = False) -> str | None:
    """None if ``data`` is a whole cubin (ELF), fatbin, LTO-IR, PTX, symbol map or manifest; else why not.

    Local entries carry no digest, so this checks framing only: it catches truncation
    and foreign files, not a flipped byte inside a well-formed cubin. With
    ``unknown_ok``, bytes of no format known here pass (only a known format cut short,
    or nothing at all, fails): what ``push`` uses, so it never vouches for a truncated
    cubin yet still carries formats this module does not know.
    """
    if not data:
        return "empty"
    if data[:1] == b"{" and b'"tiered-progcache/' in data:  # claims to be one of our documents
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return "not a whole JSON document (a symbol map or manifest cut short?)"
        if isinstance(doc, dict) and doc.get("format") in DOCUMENT_FORMATS:
            return None
        return None if unknown_ok else "a JSON document of no format stored here"
    if data[:4] == b"\x7fELF":
        if len(data) < 64 or data[4] != 2 or data[5] != 1:
            return "truncated or not a 64-bit little-endian ELF"
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
            return f"truncated ELF ({len(data)} bytes; its headers reach past the end)"
        return None
    if data[:4] == b"\x50\xed\x55\xba":  # fatbin
        if len(data) < 16:
            return "truncated fatbin"
        header_size, body_size = struct.unpack_from("<HQ", data, 6)
        if header_size + body_size > len(data):
            return f"truncated fatbin ({len(data)} bytes of {header_size + body_size})"
        return None
    if data[:4] == b"\xedCN\x7f":  # NVRTC/nvJitLink LTO-IR
        return None
    if b"\0" not in data[:4096] and b".version" in data[:4096] and b".target" in data[:4096]:
        return None  # PTX
    return None if unknown_ok else "not a cubin, fatbin, LTO-IR or PTX (unknown format)"


_PTX_TARGET = re.compile(rb"^\s*\.target\s+sm_(\d+)", re.MULTILINE)
#: ELF ``EI_ABIVERSION`` from which NVIDIA moved the SM number to bits 8-15 of ``e_flags``.
_NEW_CUDA_ABI = 8


def code_arch(data: bytes) -> int | None:
    """The SM number a cubin or PTX targets (90 for sm_90 and sm_90a), or None where it cannot tell.

    A cubin's ``e_flags`` holds it (bits 8-15 since ELF ABI version 8, bits 0-7
    before); PTX names it in ``.target``. Fatbins (several arches), LTO-IR and
    anything else: None.
    """
    if data[:4] == b"\x7fELF":
        if len(data) < 0x34:
            return None
        (flags,) = struct.unpack_from("<I", data, 0x30)
        return (flags >> 8) & 0xFF if data[8] >= _NEW_CUDA_ABI else flags & 0xFF
    if b"\0" not in data[:4096]:
        match = _PTX_TARGET.search(data[:4096])
        if match:
            return int(match.group(1))
    return None
