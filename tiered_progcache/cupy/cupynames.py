"""What a CuPy kernel-cache entry is called and how it is stored, locally and in a shared store.

CuPy names each entry itself: ``<sha1 hex>.cubin`` (``.ltoir`` for LTO IR), the SHA-1 of
everything its key covers (``cupy.cuda.compiler._compile_with_cache_cuda``). A kernel
whose options carry ``-I`` directories of the user's gets a second name,
``<CuPy's sha1>-h<40 hex>.cubin``, from :func:`header_name`: CuPy's name and the
digest of the headers it can read there (:mod:`tiered_progcache.cupy.headerkeys`).

Locally the file is exactly what CuPy's ``DiskKernelCacheBackend`` writes: the SHA-1 hex
of the payload, then the payload (:func:`encode_local`), written through a temporary
file and ``os.replace``. In a shared store, CuPy entry ``N`` is the key ``cupy/N``
under entry name ``sha256(b"cupy/N")`` in the ``cupy`` namespace, its payload framed
(:data:`FRAME_MAGIC`, one JSON line naming ``N``, the payload) so an object moved under
another name is refused. This module imports no CuPy: the command reads CuPy's directory without it.
"""

from __future__ import annotations

import hashlib
import json
import re

from ..errors import EntryRejected
from ..stores.store import entry_name

__all__ = [
    "FRAME_MAGIC",
    "KEY_PREFIX",
    "NAMESPACE",
    "cache_key",
    "check_name",
    "decode_local",
    "describe",
    "encode_local",
    "frame",
    "header_name",
    "is_name",
    "name_of",
    "opened",
    "unframe",
]

#: The shared stores' namespace for CuPy's entries: ``<url>/cupy/``, ``<prefix>:cupy:`` on Redis.
NAMESPACE = "cupy"
#: Every CuPy entry's program-cache key starts with this: ``cupy/<name>``.
KEY_PREFIX = "cupy/"
#: The first bytes of every stored CuPy payload (then one JSON line, then CuPy's payload).
FRAME_MAGIC = b"TPCCUPY1\n"
#: CuPy's names (40 hex, an extension) and ours (CuPy's, ``-h``, 40 hex of the header digest).
_NAME = re.compile(r"[0-9a-f]{40}(?:-h[0-9a-f]{40})?\.[a-z0-9]{1,16}")
_SHA1_HEX = 40
_MAX_FRAME_LINE = 256
_HEADER_NAME_VERSION = b"tiered-progcache/cupy-header-name/1\0"


def is_name(name: object) -> bool:
    """True for a CuPy cache entry name (or its header-keyed second name)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(name: object) -> str:
    """``name`` if it is a CuPy cache entry name, else TypeError/ValueError naming the form expected."""
    if not isinstance(name, str):
        raise TypeError(f"a CuPy cache name must be a str, got {type(name).__name__}")
    if not is_name(name):
        raise ValueError(f"not a CuPy cache name (40 hex digits and an extension, such as <sha1>.cubin): {name!r}")
    return name


def header_name(name: str, digest: bytes) -> str:
    """The second name of CuPy entry ``name`` for headers of ``digest``: ``<stem>-h<40 hex>.<ext>``.

    Derived from CuPy's name and the digest only, so every node that reads the same headers agrees.
    """
    stem, dot, ext = check_name(name).partition(".")
    if "-h" in stem:
        raise ValueError(f"{name!r} is already a header-keyed name")
    mixed = hashlib.sha1(_HEADER_NAME_VERSION + stem.encode() + b"\0" + digest, usedforsecurity=False).hexdigest()
    return f"{stem}-h{mixed}{dot}{ext}"


def cache_key(name: str) -> bytes:
    """The program-cache key of CuPy entry ``name``: ``b"cupy/<name>"``."""
    return f"{KEY_PREFIX}{check_name(name)}".encode()


def name_of(name: str) -> str:
    """The entry name (64 hex) of CuPy entry ``name`` in a shared store."""
    return entry_name(cache_key(name))


# -- CuPy's local file format ---------------------------------------------------------------------


def encode_local(payload: bytes) -> bytes:
    """The bytes of CuPy's file for ``payload``: its SHA-1 in ASCII hex, then the payload."""
    return hashlib.sha1(payload, usedforsecurity=False).hexdigest().encode("ascii") + payload


def decode_local(data: bytes) -> bytes | None:
    """The payload of a CuPy file, or None if it is truncated or does not match its SHA-1 (as CuPy decides)."""
    if len(data) < _SHA1_HEX:
        return None
    payload = data[_SHA1_HEX:]
    if data[:_SHA1_HEX] != hashlib.sha1(payload, usedforsecurity=False).hexdigest().encode("ascii"):
        return None
    return payload


# -- frames in a shared store ---------------------------------------------------------------------


def frame(name: str, payload: bytes) -> bytes:
    """The object stored for CuPy entry ``name``: :data:`FRAME_MAGIC`, ``{"name": ...}``, newline, payload."""
    line = json.dumps({"name": check_name(name)}, sort_keys=True)
    return b"".join((FRAME_MAGIC, line.encode(), b"\n", payload))


def unframe(stored: bytes) -> tuple[str, bytes] | None:
    """(CuPy name, payload) of a stored object, or None if it is not a CuPy entry."""
    if not stored.startswith(FRAME_MAGIC):
        return None
    end = stored.find(b"\n", len(FRAME_MAGIC), len(FRAME_MAGIC) + _MAX_FRAME_LINE)
    if end < 0:
        return None
    try:
        doc = json.loads(stored[len(FRAME_MAGIC) : end])
        name = check_name(doc["name"])
    except (ValueError, TypeError, KeyError):
        return None
    return name, stored[end + 1 :]


def describe(stored: bytes) -> str | None:
    """The CuPy name a stored object holds, or None if it is not a CuPy entry."""
    parsed = unframe(stored)
    return None if parsed is None else parsed[0]


def opened(stored: bytes, name: str) -> bytes:
    """CuPy's payload from a stored object, checked to be entry ``name``; ``EntryRejected`` if not."""
    parsed = unframe(stored)
    if parsed is None:
        raise EntryRejected(f"not a CuPy entry (no {FRAME_MAGIC[:-1].decode()} frame): cupy/{name}")
    held, payload = parsed
    if held != name:
        raise EntryRejected(f"entry holds cupy/{held}, not cupy/{name}")
    return payload
