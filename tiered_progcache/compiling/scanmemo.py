"""Header scans persisted in the local cache directory, so a new process skips the scan.

Without it, the first ``compile()`` hit of a ``cub::BlockReduce`` kernel in a fresh process
scans 1,691 CCCL headers (the whole tree: a computed ``#include`` in Thrust forces the
directory fallback) before it can even form the key. The scan's result (digest, every
path probed with its stat signature, the directories' realpaths, and whatever else
``headermemo.ScanResult`` holds) is written here after a scan; a later process loads it
and validates it by stat exactly as the in-process memo is validated (watched first
where inotify is trusted; a header modified within ``RACY_NS`` is not trusted) before
using it. An edit between processes is therefore seen like an edit within one.

Layout and bounds: ``<local dir>/header-scans/<64 hex>.json``, named by a digest of the
in-process memo key (source, the options' path fields, the working directory) and of
the scanner's own code, so a memo written by another version of the scanner is never
read. At most :data:`MAX_FILES` files and :data:`MAX_BYTES` bytes (least recently used
removed first: a load sets the file's atime, as cuda-core's entries do); a scan whose
memo would exceed :data:`MAX_FILE_BYTES` is not persisted.

Format: JSON only (never pickle): one header line ``{"format", "key", "sha256",
"bytes"}`` then the body, checked against both; the body is the document the caller's
codec made (``headermemo``'s, for a scan). A file that is not exactly that (torn, corrupt,
over the size cap, written for another key, another format, a body the codec refuses) is
ignored and the scan runs again, which replaces it. The memo is as
trusted as the directory it lives in, like the entries beside it: whoever can write the
cache directory can already plant a cubin.

Written atomically (stage in the same directory, then rename); the directory is made
with the library's modes (never world-writable) and never through a planted symlink.
Safe across threads and processes: writers race harmlessly (last rename wins, both
wrote a valid scan), readers see a whole file or none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..stores import fsutil
from ..stores.ratelimit import log_once

__all__ = ["FORMAT", "MAX_BYTES", "MAX_FILES", "MAX_FILE_BYTES", "ScanMemoStore", "memo_name"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The format tag of the header line; a change of layout changes it.
FORMAT = "tiered-progcache/header-scan/3"
#: Memo files kept in one directory.
MAX_FILES = 512
#: Bytes kept in one directory (a CUB BlockReduce scan's memo is about 160 KB).
MAX_BYTES = 64 << 20
#: Largest memo written or read.
MAX_FILE_BYTES = 8 << 20

_SUFFIX = ".json"
_STAGED_PREFIX = "stage-"
_STALE_STAGED_S = 3600.0


class _Refused(Exception):
    """A memo file that is not a regular file within the cap (:func:`~tiered_progcache.stores.fsutil.open_regular`)."""


def memo_name(memo_key: tuple[Any, ...], scanner_id: bytes) -> str:
    """The 64-hex file name for an in-process memo key (str, bytes, bool, None and tuples of them)."""
    h = hashlib.sha256(FORMAT.encode(), usedforsecurity=False)
    h.update(len(scanner_id).to_bytes(8, "big") + scanner_id)
    _feed(h, memo_key)
    return h.hexdigest()


def _feed(h: Any, value: object) -> None:
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"T" if value else b"F")
    elif isinstance(value, (str, bytes)):
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        h.update((b"s" if isinstance(value, str) else b"b") + len(data).to_bytes(8, "big") + data)
    elif isinstance(value, tuple):
        h.update(b"(" + len(value).to_bytes(8, "big"))
        for item in value:
            _feed(h, item)
    else:
        raise TypeError(f"a memo key holds str, bytes, bool, None and tuples, not {type(value).__name__}")


class ScanMemoStore:
    """One directory of persisted scans (``<local dir>/header-scans``).

    >>> store = ScanMemoStore("/var/cache/kernels/header-scans")
    >>> store.save(name, {"digest": "..."}); store.load(name, decode=scan_from_document)

    ``max_files`` / ``max_bytes`` bound the directory, ``max_file_bytes`` one memo.
    Never raises on I/O: a failed save is logged once and skipped, a failed load is a miss.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_files: int = MAX_FILES,
        max_bytes: int = MAX_BYTES,
        max_file_bytes: int = MAX_FILE_BYTES,
    ) -> None:
        for label, value in (("max_files", max_files), ("max_bytes", max_bytes), ("max_file_bytes", max_file_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{label} must be at least 1, got {value}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.max_file_bytes = max_file_bytes

    def __repr__(self) -> str:
        return f"ScanMemoStore({self.directory!r})"

    def path_for(self, name: str) -> str:
        if len(name) != 64 or not all(c in "0123456789abcdef" for c in name):
            raise ValueError(f"a memo name is 64 lowercase hex digits, got {name!r}")
        return os.path.join(self.directory, name + _SUFFIX)

    # -- reading ------------------------------------------------------------------------------

    def load(self, name: str, decode: Callable[[Any], T]) -> T | None:
        """``decode(document)`` of the document saved under ``name``; None if absent, or bad (``decode`` raised
        ValueError, TypeError or KeyError: logged once)."""
        path = self.path_for(name)
        try:
            fd, st = fsutil.open_regular(path, self.max_file_bytes, refuse=_Refused)
        except _Refused as exc:
            return self._bad(path, str(exc))
        except OSError:
            return None
        try:
            data = _read_all(fd, self.max_file_bytes + 1)
            try:
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))  # used: last to be evicted
            except OSError:
                pass
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) > self.max_file_bytes:
            return self._bad(path, "over the size cap")
        try:
            return decode(_body(data, name))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            return self._bad(path, str(exc))

    def _bad(self, path: str, why: str) -> None:
        log_once(logger, f"bad-memo:{path}", logging.INFO, "ignoring header scan memo %s (%s): scanning again", path, why)
        return None

    # -- writing ------------------------------------------------------------------------------

    def save(self, name: str, document: Any) -> bool:
        """Persist the JSON document ``document`` under ``name`` (atomically), then keep the directory in bounds.

        False (logged once) if it has no JSON form, is over ``max_file_bytes`` or cannot be written.
        """
        path = self.path_for(name)
        try:
            body = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            log_once(logger, "memo-encode", logging.WARNING, "header scans are not persisted: %s", exc)
            return False
        head = json.dumps({"format": FORMAT, "key": name, "sha256": hashlib.sha256(body).hexdigest(),
                           "bytes": len(body)}).encode()
        data = head + b"\n" + body
        if len(data) > self.max_file_bytes:
            log_once(logger, "memo-too-big", logging.INFO,
                     "a header scan memo of %d bytes is over the %d-byte cap: not persisted", len(data),
                     self.max_file_bytes)
            return False
        try:
            fsutil.make_dirs(self.directory, below=os.path.dirname(self.directory))
            fsutil.write_atomic(path, data, staging_dir=self.directory, fsync=False)
        except OSError as exc:
            log_once(logger, f"memo-write:{self.directory}", logging.WARNING,
                     "cannot persist header scans in %s: %s", self.directory, exc)
            return False
        self.enforce_bounds(keep=name)
        return True

    def enforce_bounds(self, *, keep: str | None = None) -> int:
        """Remove least recently used memos until within ``max_files`` and ``max_bytes``; returns how many.

        ``keep`` (the memo just written) goes last. Staged files older than an hour (a
        writer killed before its rename) are removed too.
        """
        memos: list[tuple[float, int, str]] = []
        removed = 0
        now = time.time()
        try:
            listing = list(os.scandir(self.directory))
        except OSError:
            return 0
        for item in listing:
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            if item.name.startswith(_STAGED_PREFIX):
                if now - st.st_mtime > _STALE_STAGED_S and _unlink(item.path):
                    removed += 1
                continue
            if not item.name.endswith(_SUFFIX):
                continue
            used = float("inf") if keep is not None and item.name == keep + _SUFFIX else st.st_atime
            memos.append((used, st.st_size, item.path))
        memos.sort()
        count, total = len(memos), sum(size for _, size, _ in memos)
        for _, size, path in memos:
            if count <= self.max_files and total <= self.max_bytes:
                break
            if _unlink(path):
                removed += 1
            count -= 1
            total -= size
        return removed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.debug("could not remove %s: %s", path, exc)
        return False
    return True


def _read_all(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, limit - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _body(data: bytes, name: str) -> Any:
    """The document in a memo file's body, once its header line vouches for it (ValueError where it does not)."""
    newline = data.find(b"\n")
    if newline < 0:
        raise ValueError("no header line")
    head = json.loads(data[:newline])
    body = data[newline + 1 :]
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError("another format")
    if head.get("key") != name:
        raise ValueError("written for another key")
    if head.get("bytes") != len(body) or head.get("sha256") != hashlib.sha256(body).hexdigest():
        raise ValueError("torn or corrupt: the body does not match its digest")
    return json.loads(body)
