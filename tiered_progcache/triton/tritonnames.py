"""What a Triton file is called and how it is stored in a shared store: names, frames, group records.

Triton file ``F`` of Triton key ``K`` (its base32 cache-directory name) is the key
``triton/K/F``, stored under entry name ``sha256(b"triton/K/F")`` in the shared stores'
``triton`` namespace. Its payload is *framed*: :data:`FRAME_MAGIC`, one JSON line
naming ``K`` and ``F``, then the file's bytes, so an entry says which file it holds and
one moved under another name is refused. A group is its members plus one *group
record* (``triton/K/__grp__F``): JSON listing each member with the sha256 of its bytes.
This module imports no Triton: the command reads and writes Triton's directory without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..errors import EntryRejected
from ..stores.store import entry_name

__all__ = [
    "FRAME_MAGIC",
    "GROUP_PREFIX",
    "KEY_PREFIX",
    "MAX_GROUP_MEMBERS",
    "MAX_GROUP_RECORD_BYTES",
    "NAMESPACE",
    "TritonFile",
    "cache_key",
    "describe",
    "frame",
    "group_record",
    "name_of",
    "opened",
    "read_group_record",
    "unframe",
]

#: The shared stores' namespace for Triton's files: ``<url>/triton/``, ``<prefix>:triton:`` on Redis.
NAMESPACE = "triton"
#: Every Triton file's program-cache key starts with this: ``triton/<key>/<file>``.
KEY_PREFIX = "triton/"
#: Triton's name for a group index: ``__grp__<file>``.
GROUP_PREFIX = "__grp__"
#: The first bytes of every stored Triton payload (then one JSON line, then the file's bytes).
FRAME_MAGIC = b"TPCTRITON1\n"
#: A group record past this many bytes is refused unread (a real one is a few hundred).
MAX_GROUP_RECORD_BYTES = 64 * 1024
#: Members a group record may list (Triton writes about eight: IRs, PTX, cubin, metadata).
MAX_GROUP_MEMBERS = 64
_MAX_FRAME_LINE = 4096
_GROUP_FORMAT = "tiered-progcache/triton-group"
_GROUP_VERSION = 1


class TritonFile:
    """Which Triton file an entry holds: its Triton ``key`` and ``file`` name. Immutable."""

    __slots__ = ("key", "file")

    def __init__(self, key: str, file: str) -> None:
        object.__setattr__(self, "key", _check_part("key", key))
        object.__setattr__(self, "file", _check_part("file", file))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("TritonFile is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TritonFile) and (self.key, self.file) == (other.key, other.file)

    def __hash__(self) -> int:
        return hash((self.key, self.file))

    def __repr__(self) -> str:
        return f"TritonFile({self.key!r}, {self.file!r})"

    @property
    def is_group(self) -> bool:
        """True for a group record (``__grp__<file>``)."""
        return self.file.startswith(GROUP_PREFIX)


def _check_part(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a Triton {what} must be a str, got {type(value).__name__}")
    if not value or len(value) > 255 or "/" in value or "\0" in value or value in (".", ".."):
        raise ValueError(f"not a Triton {what} (a non-empty file name without '/'): {value!r}")
    return value


def cache_key(key: str, file: str) -> bytes:
    """The program-cache key of Triton file ``file`` of Triton key ``key``: ``b"triton/<key>/<file>"``.

    >>> entry_name(cache_key("CNUVJ...", "add_kernel.cubin"))  # the object's name in a bucket
    """
    return f"{KEY_PREFIX}{_check_part('key', key)}/{_check_part('file', file)}".encode()


def name_of(key: str, file: str) -> str:
    """The entry name (64 hex) of Triton file ``file`` of key ``key``."""
    return entry_name(cache_key(key, file))


def frame(key: str, file: str, data: bytes) -> bytes:
    """The payload stored for ``data``: :data:`FRAME_MAGIC`, one JSON line naming key and file, the bytes."""
    line = json.dumps({"file": _check_part("file", file), "key": _check_part("key", key)}, sort_keys=True)
    return b"".join((FRAME_MAGIC, line.encode(), b"\n", data))


def describe(payload: bytes) -> TritonFile | None:
    """The Triton file a stored payload holds, or None if it is not a Triton entry (a cubin, a manifest).

    What ``ls`` and the other operations ask to tell Triton's entries from the program cache's.
    """
    parsed = unframe(payload)
    return None if parsed is None else parsed[0]


def unframe(payload: bytes) -> tuple[TritonFile, bytes] | None:
    if not payload.startswith(FRAME_MAGIC):
        return None
    end = payload.find(b"\n", len(FRAME_MAGIC), len(FRAME_MAGIC) + _MAX_FRAME_LINE)
    if end < 0:
        return None
    try:
        doc = json.loads(payload[len(FRAME_MAGIC) : end])
        which = TritonFile(doc["key"], doc["file"])
    except (ValueError, TypeError, KeyError):
        return None
    return which, payload[end + 1 :]


def opened(payload: bytes, key: str, file: str) -> bytes:
    """The file's bytes from a stored payload, checked to be ``key``/``file``; ``EntryRejected`` if not."""
    parsed = unframe(payload)
    if parsed is None:
        raise EntryRejected(f"not a Triton entry (no {FRAME_MAGIC[:-1].decode()} frame): triton/{key}/{file}")
    which, data = parsed
    if which != TritonFile(key, file):
        raise EntryRejected(f"entry holds triton/{which.key}/{which.file}, not triton/{key}/{file}")
    return data


def group_record(key: str, group_file: str, members: Mapping[str, bytes]) -> bytes:
    doc = {
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(members.items())},
        "format": _GROUP_FORMAT,
        "group": group_file,
        "key": key,
        "version": _GROUP_VERSION,
    }
    return json.dumps(doc, sort_keys=True).encode()


def read_group_record(data: bytes, key: str, group_file: str) -> dict[str, str]:
    """Member file -> sha256 hex, from a group record; ``EntryRejected`` for anything malformed or foreign."""
    if len(data) > MAX_GROUP_RECORD_BYTES:
        raise EntryRejected(f"group record of {len(data)} bytes, over the {MAX_GROUP_RECORD_BYTES}-byte bound")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise EntryRejected(f"group record is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != _GROUP_FORMAT or doc.get("version") != _GROUP_VERSION:
        raise EntryRejected("not a group record of this version")
    if doc.get("key") != key or doc.get("group") != group_file:
        raise EntryRejected("group record of another key or group")
    files = doc.get("files")
    if not isinstance(files, dict) or not files or len(files) > MAX_GROUP_MEMBERS:
        raise EntryRejected(f"group record lists no members, or more than {MAX_GROUP_MEMBERS}")
    for name, digest in files.items():
        try:
            _check_part("file", name)
        except (TypeError, ValueError) as exc:
            raise EntryRejected(f"group record lists a bad member: {exc}") from None
        if name.startswith(GROUP_PREFIX) or not isinstance(digest, str) or len(digest) != 64:
            raise EntryRejected(f"group record lists a bad member: {name!r}")
    return files
