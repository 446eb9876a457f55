"""The header digest memo persisted in the local cache directory, so a new process hashes nothing known.

What :mod:`.headermemo` remembers of each header file, its sha256, keyed by path and
validated by stat exactly as the in-process memo is: an entry stands only while the file's ``(inode, size, mtime_ns,
ctime_ns)`` is what was recorded, and a file modified within ``RACY_NS`` of its hashing
is never recorded (nor loaded, should a planted file hold one). A fresh process on a node
that has this file then verifies a direct manifest's header set by ``stat`` alone for
every file it saw before: no read, no hash. (A scan still reads the files it lexes: it
runs only where no header set holds, before a compile that costs far more.)

Layout and bounds: ``<local dir>/header-scans/files-<16 hex>.json``, named by this
module's format: a memo written in another format is never read, and a save removes
other formats' files. One file of at
most :data:`MAX_ENTRIES` entries and :data:`MAX_FILE_BYTES` bytes, this process's entries
first, then those it read back from the file (the rest dropped): a bound, never a wipe.

Format: JSON only (never pickle): one header line ``{"format", "sha256", "bytes"}`` then
the body by columns ``{"paths": [...], "stats": [inode, size, mtime_ns, ctime_ns, ...],
"sha256": "<64 hex per path>"}`` (a tenth of the JSON values a list per row takes). A file
that is not exactly that (torn, corrupt, over the cap, columns of the wrong type or
length) is ignored whole, and the next save replaces it. Trusted as the directory it
lives in, like the entries beside it: whoever can write it can already plant a cubin.

Written atomically (staged in the same directory, then renamed), the directory made with
the library's modes and never through a planted symlink. Across processes: a save merges
what is on disk with this process's entries, so writers racing lose entries at worst
(a later process hashes those files once more); readers see a whole file or none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ..stores import fsutil
from ..stores.ratelimit import log_once

__all__ = ["FORMAT", "MAX_ENTRIES", "MAX_FILE_BYTES", "Persisted", "Row", "load", "memo_path", "save"]

logger = logging.getLogger(__name__)

#: The format tag of the header line; a change of layout changes it.
FORMAT = "tiered-progcache/header-files/1"
#: Entries one memo file keeps (a CUB BlockReduce kernel reads about 600 headers).
MAX_ENTRIES = 50_000
#: Largest memo file written or read (about 150 bytes an entry).
MAX_FILE_BYTES = 16 << 20

#: ``(path, ("f", inode, size, mtime_ns, ctime_ns), sha256)``: a regular file's signature and digest.
Row = tuple[str, tuple[Any, ...], bytes]

_PREFIX, _SUFFIX = "files-", ".json"
_STAGED_PREFIX, _STALE_STAGED_S = "stage-", 3600.0  # fsutil's staging names; an hour: its writer was killed
_NAME = f"{_PREFIX}{hashlib.sha256(FORMAT.encode()).hexdigest()[:16]}{_SUFFIX}"


class Persisted:
    """The rows of one memo file, kept by column: a row is built only when its path is looked up
    (a fresh process loads a CUB kernel's 610 rows and uses them in about a millisecond)."""

    __slots__ = ("_index", "_paths", "_raw", "_stats")

    def __init__(self, paths: list[str], stats: list[int], raw: bytes) -> None:
        self._paths, self._stats, self._raw = paths, stats, raw
        self._index: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self._paths)

    def get(self, path: str) -> tuple[tuple[Any, ...], bytes] | None:
        """``(signature, sha256)`` recorded for ``path``, or None. Not thread-safe: the caller holds its lock."""
        if self._index is None:
            n = len(self._paths)
            self._index = dict(zip(reversed(self._paths), range(n - 1, -1, -1)))  # a repeated path: its first row
        i = self._index.get(path)
        if i is None:
            return None
        return ("f", *self._stats[4 * i:4 * i + 4]), self._raw[32 * i:32 * i + 32]

    def rows(self) -> list[Row]:
        """Every row, in the file's order (newest first)."""
        st, raw = self._stats, self._raw
        return [(p, ("f", *st[4 * i:4 * i + 4]), raw[32 * i:32 * i + 32]) for i, p in enumerate(self._paths)]


_EMPTY = Persisted([], [], b"")


class _Refused(Exception):
    """A memo file that is not a regular file within the cap."""


def memo_path(directory: str | os.PathLike[str]) -> str:
    """The memo file in ``directory`` that this version reads and writes."""
    return os.path.join(os.fspath(directory), _NAME)


def load(directory: str | os.PathLike[str]) -> Persisted:
    """The rows persisted in ``directory`` (none where there is no file, or it is not exactly the format)."""
    path = memo_path(directory)
    try:
        fd, _ = fsutil.open_regular(path, MAX_FILE_BYTES, refuse=_Refused)
    except _Refused as exc:
        return _bad(path, str(exc))
    except OSError:
        return _EMPTY
    try:
        data = _read_all(fd, MAX_FILE_BYTES + 1)
    except OSError:
        return _EMPTY
    finally:
        os.close(fd)
    try:
        return _decode(data)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        return _bad(path, str(exc))


def save(directory: str | os.PathLike[str], rows: Iterable[Row]) -> bool:
    """Persist ``rows`` (newest first) ahead of those on disk, within the bounds; False (logged once) on failure."""
    directory = os.path.abspath(os.fspath(directory))
    path = memo_path(directory)
    merged: dict[str, Row] = {}
    for row in (*rows, *load(directory).rows()):
        if len(merged) >= MAX_ENTRIES:
            break
        merged.setdefault(row[0], row)
    kept = list(merged.values())
    body = _encode(kept)
    while len(body) > MAX_FILE_BYTES - 256:  # paths of extraordinary length: keep the newest half
        kept = kept[: len(kept) // 2]
        body = _encode(kept)
    head = json.dumps({"format": FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}).encode()
    try:
        fsutil.make_dirs(directory, below=os.path.dirname(directory))
        fsutil.write_atomic(path, head + b"\n" + body, staging_dir=directory, fsync=False)
    except OSError as exc:
        log_once(logger, f"digest-memo-write:{directory}", logging.WARNING,
                 "cannot persist header digests in %s: %s", directory, exc)
        return False
    _remove_other_versions(directory, os.path.basename(path))
    return True


def _encode(rows: Sequence[Row]) -> bytes:
    """The body: the rows by columns (a path column, the stat numbers flat, the digests as one hex string)."""
    doc = {"paths": [r[0] for r in rows], "stats": [n for r in rows for n in r[1][1:]],
           "sha256": "".join(r[2].hex() for r in rows)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _decode(data: bytes) -> Persisted:
    newline = data.find(b"\n")
    if newline < 0:
        raise ValueError("no header line")
    head, body = json.loads(data[:newline]), data[newline + 1:]
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError("another format")
    if head.get("bytes") != len(body) or head.get("sha256") != hashlib.sha256(body).hexdigest():
        raise ValueError("torn or corrupt: the body does not match its digest")
    doc = json.loads(body)
    if not isinstance(doc, dict) or set(doc) != {"paths", "stats", "sha256"}:
        raise ValueError("not a header file memo")
    paths, stats, digests = doc["paths"], doc["stats"], doc["sha256"]
    if type(paths) is not list or type(stats) is not list or type(digests) is not str:
        raise ValueError("a column of the wrong type")
    n = len(paths)
    if n > MAX_ENTRIES or len(stats) != 4 * n or len(digests) != 64 * n:
        raise ValueError("columns of different lengths, or over the bound")
    if (n and set(map(type, paths)) != {str}) or (n and set(map(type, stats)) != {int}) or min(stats, default=0) < 0:
        raise ValueError("a path that is not a str, or a stat field that is not a natural number")
    return Persisted(paths, stats, bytes.fromhex(digests))


def _remove_other_versions(directory: str, keep: str) -> None:
    """Memo files another version wrote (never read by this one), and files staged by a killed writer."""
    try:
        names: Sequence[str] = os.listdir(directory)
    except OSError:
        return
    now = time.time()
    for name in names:
        other = name != keep and name.startswith(_PREFIX) and name.endswith(_SUFFIX)
        path = os.path.join(directory, name)
        try:
            if other or (name.startswith(_STAGED_PREFIX) and now - os.lstat(path).st_mtime > _STALE_STAGED_S):
                os.unlink(path)
        except OSError as exc:
            logger.debug("could not remove %s: %s", name, exc)


def _bad(path: str, why: str) -> Persisted:
    log_once(logger, f"bad-digest-memo:{path}", logging.INFO, "ignoring header file memo %s (%s)", path, why)
    return _EMPTY


def _read_all(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, limit - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
