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
"bytes"}`` then the body, checked against both. Rows of a fixed shape (the probed paths
with their stat signatures, the files covered) are written by columns, a signature column
as its lengths and its items flat: a tenth of the JSON values a list per row takes, so a
fresh process loads a ``cub::BlockReduce`` scan's memo in about a third of the time. A file that is not exactly that (torn,
corrupt, over the size cap, written for another key, another format, a value of the
wrong type) is ignored and the scan runs again, which replaces it. The memo is as
trusted as the directory it lives in, like the entries beside it: whoever can write the
cache directory can already plant a cubin.

Written atomically (stage in the same directory, then rename); the directory is made
with the library's modes (never world-writable) and never through a planted symlink.
Safe across threads and processes: writers race harmlessly (last rename wins, both
wrote a valid scan), readers see a whole file or none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from ..stores import fsutil
from ..stores.ratelimit import log_once

__all__ = ["FORMAT", "MAX_BYTES", "MAX_FILES", "MAX_FILE_BYTES", "PER_PROCESS", "ScanMemoStore", "memo_name"]

logger = logging.getLogger(__name__)

#: The format tag of the header line; a change of layout changes it.
FORMAT = "tiered-progcache/header-scan/2"
#: Memo files kept in one directory.
MAX_FILES = 512
#: Bytes kept in one directory (a CUB BlockReduce scan's memo is about 160 KB).
MAX_BYTES = 64 << 20
#: Largest memo written or read.
MAX_FILE_BYTES = 8 << 20
#: ``dataclasses.field(metadata=PER_PROCESS)`` marks a field that is not persisted (a process's own state).
PER_PROCESS = types.MappingProxyType({"per_process": True})

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
    >>> store.save(name, result); store.load(name, ScanResult, checked_at=time.monotonic())

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

    def load(self, name: str, cls: type, **per_process: Any) -> Any:
        """The dataclass ``cls`` saved under ``name``, its per-process fields set from ``per_process``; None if absent or bad."""
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
            return _decode_file(data, name, cls, per_process)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            return self._bad(path, str(exc))

    def _bad(self, path: str, why: str) -> None:
        log_once(logger, f"bad-memo:{path}", logging.INFO, "ignoring header scan memo %s (%s): scanning again", path, why)
        return None

    # -- writing ------------------------------------------------------------------------------

    def save(self, name: str, result: Any) -> bool:
        """Persist the dataclass ``result`` under ``name`` (atomically), then keep the directory in bounds.

        False (logged once) if it cannot be encoded, is over ``max_file_bytes`` or cannot be written.
        """
        path = self.path_for(name)
        try:
            body = json.dumps(_encode(result), separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            log_once(logger, f"memo-encode:{type(result).__name__}", logging.WARNING,
                     "header scans are not persisted: %s", exc)
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


def _decode_file(data: bytes, name: str, cls: type, per_process: dict[str, Any]) -> Any:
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
    return _decoder(cls)(json.loads(body), per_process)


# -- the generic codec: a dataclass's fields, by their type hints ---------------------------------


def _encode(value: Any) -> Any:
    """JSON-able form of a (nested) dataclass: bytes as hex, tuples as lists; per-process fields left out.

    A field typed ``tuple[tuple[A, B, ...], ...]`` (rows of a fixed shape: the probed paths and
    their signatures, the files covered) is written by columns (:func:`_encode_rows`).
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = _hints(type(value))
        out = {}
        for f in dataclasses.fields(value):
            if f.metadata.get("per_process"):
                continue
            shape = _row_shape(hints[f.name])
            item = getattr(value, f.name)
            out[f.name] = _encode_rows(item, shape) if shape is not None else _encode(item)
        return out
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, (tuple, list)):
        return [_encode(item) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a persisted dict needs str keys")
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot persist a {type(value).__name__}")


_hints_of: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    found = _hints_of.get(cls)
    if found is None:
        found = _hints_of[cls] = typing.get_type_hints(cls)
    return found


def _row_shape(hint: Any) -> tuple[Any, ...] | None:
    """The column hints of ``tuple[tuple[A, B, ...], ...]``; None for any other hint."""
    if typing.get_origin(hint) is not tuple:
        return None
    args = typing.get_args(hint)
    if len(args) != 2 or args[1] is not Ellipsis or typing.get_origin(args[0]) is not tuple:
        return None
    shape = typing.get_args(args[0])
    if not shape or Ellipsis in shape or shape == ((),):
        return None
    return shape


def _is_flat_tuple_or_none(hint: Any) -> bool:
    """``Optional[tuple[Any, ...]]``: a stat signature (a tag and numbers) or None."""
    return typing.get_origin(hint) in _UNION_TYPES and set(typing.get_args(hint)) == {tuple[Any, ...], type(None)}


def _encode_rows(rows: Any, shape: tuple[Any, ...]) -> list[Any]:
    """Rows as ``[count, column 0, column 1, ...]``: far fewer JSON values to parse than a list per row.

    A column of ``Optional[tuple[Any, ...]]`` (signatures) is ``[lengths, flat items]``, a
    length of -1 for None; any other column is the list of its encoded values.
    """
    if not isinstance(rows, (tuple, list)) or not all(isinstance(r, tuple) and len(r) == len(shape) for r in rows):
        raise TypeError(f"rows of {len(shape)} items expected")
    out: list[Any] = [len(rows)]
    for i, hint in enumerate(shape):
        column = [r[i] for r in rows]
        if _is_flat_tuple_or_none(hint):
            lengths, flat = [], []
            for item in column:
                if item is None:
                    lengths.append(-1)
                    continue
                if not isinstance(item, tuple) or not all(type(x) in _SCALARS for x in item):
                    raise TypeError("a signature holds plain values only")
                lengths.append(len(item))
                flat.extend(item)
            out.append([lengths, flat])
        else:
            out.append([_encode(item) for item in column])
    return out


_SCALARS = frozenset({str, int, float, bool, type(None)})
_INT = frozenset({int})
_UNION_TYPES = (Union, getattr(types, "UnionType", Union))
_decoders: dict[Any, Callable[..., Any]] = {}


def _decoder(cls: type) -> Callable[[Any, dict[str, Any]], Any]:
    """A function JSON -> ``cls`` built once from its type hints; TypeError/ValueError on a mismatch."""
    found = _decoders.get(cls)
    if found is None:
        hints = _hints(cls)
        fields = [(f.name, _value_decoder(hints[f.name])) for f in dataclasses.fields(cls)
                  if not f.metadata.get("per_process")]
        names = {name for name, _ in fields}

        def decode(obj: Any, per_process: dict[str, Any]) -> Any:
            if not isinstance(obj, dict) or set(obj) != names:
                raise ValueError(f"{cls.__name__}: fields {sorted(obj) if isinstance(obj, dict) else type(obj).__name__},"
                                 f" expected {sorted(names)}")
            return cls(**{name: dec(obj[name]) for name, dec in fields}, **per_process)

        found = _decoders[cls] = decode
    return found


def _value_decoder(hint: Any) -> Callable[[Any], Any]:
    """A decoder for one type hint: Any, None, bool, int, float, str, bytes, tuple[...], list[X],
    dict[str, X], Optional/Union and dataclasses. Another hint is a TypeError when the decoder is built."""
    if hint is Any:
        return _any
    if hint is type(None) or hint is None:
        return _exact(type(None))
    if hint in (bool, str):
        return _exact(hint)
    if hint is int:
        return lambda v: v if type(v) is int else _wrong("int", v)
    if hint is float:
        return lambda v: float(v) if type(v) in (int, float) else _wrong("float", v)
    if hint is bytes:
        return lambda v: bytes.fromhex(v) if type(v) is str else _wrong("hex bytes", v)
    if dataclasses.is_dataclass(hint):
        inner = _decoder(hint)
        return lambda v: inner(v, {})
    shape = _row_shape(hint)
    if shape is not None:
        return _rows_decoder(shape)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is Any:
                return lambda v: _any(v) if type(v) is list else _wrong("list", v)
            item = _value_decoder(args[0])
            return lambda v: tuple(map(item, v)) if type(v) is list else _wrong("list", v)
        items = [_value_decoder(a) for a in args]
        if len(items) == 2:  # (path, signature): the bulk of a scan, kept tight
            first, second = items

            def pair(v: Any) -> tuple[Any, ...]:
                if type(v) is not list or len(v) != 2:
                    _wrong("list of 2", v)
                return (first(v[0]), second(v[1]))

            return pair

        def fixed(v: Any) -> tuple[Any, ...]:
            if type(v) is not list or len(v) != len(items):
                _wrong(f"list of {len(items)}", v)
            return tuple(dec(x) for dec, x in zip(items, v))

        return fixed
    if origin is list:
        item = _value_decoder(args[0])
        return lambda v: list(map(item, v)) if type(v) is list else _wrong("list", v)
    if origin is dict and args and args[0] is str:
        item = _value_decoder(args[1])
        return lambda v: {k: item(x) for k, x in v.items()} if type(v) is dict else _wrong("object", v)
    if origin in _UNION_TYPES:
        options = [(a, _value_decoder(a)) for a in args]
        others = [dec for a, dec in options if a is not type(None)]
        if len(others) == 1 and len(options) == 2:  # Optional[X]
            only = others[0]
            return lambda v: None if v is None else only(v)

        def union(v: Any) -> Any:
            if v is None and type(None) in args:
                return None
            for arg, dec in options:
                if arg is type(None):
                    continue
                try:
                    return dec(v)
                except (TypeError, ValueError):
                    continue
            return _wrong(str(hint), v)

        return union
    raise TypeError(f"no JSON form for {hint!r}")


def _rows_decoder(shape: tuple[Any, ...]) -> Callable[[Any], Any]:
    """The inverse of :func:`_encode_rows`, checking every count, length and type."""
    columns = [_signatures if _is_flat_tuple_or_none(h) else _column(h) for h in shape]
    width = len(columns) + 1

    def rows(v: Any) -> tuple[tuple[Any, ...], ...]:
        if type(v) is not list or len(v) != width or type(v[0]) is not int or v[0] < 0:
            _wrong(f"[count, {width - 1} columns]", v)
        count = v[0]
        decoded = [dec(col, count) for dec, col in zip(columns, v[1:])]
        return tuple(zip(*decoded)) if count else ()

    return rows


def _column(hint: Any) -> Callable[[Any, int], list[Any]]:
    """A column decoder: of ``str``/``bool`` values checked in one pass, of any other hint item by item."""
    exact = {hint} if hint in (str, bool) else None
    item = _value_decoder(hint)

    def column(v: Any, count: int) -> list[Any]:
        if type(v) is not list or len(v) != count:
            _wrong(f"a column of {count}", v)
        if exact is not None:
            if count and not exact.issuperset(map(type, v)):
                raise ValueError(f"a column of {hint.__name__} holds another type")
            return v
        return list(map(item, v))

    return column


def _signatures(v: Any, count: int) -> list[Any]:
    """``[lengths, flat items]`` back to None or tuples of plain values."""
    if type(v) is not list or len(v) != 2:
        _wrong("[lengths, items]", v)
    lengths, flat = v
    if type(lengths) is not list or len(lengths) != count or type(flat) is not list:
        _wrong(f"{count} lengths and a list of items", v)
    if not _SCALARS.issuperset(map(type, flat)):
        raise ValueError("a signature holds plain values only")
    if count and not _INT.issuperset(map(type, lengths)) or min(lengths, default=0) < -1:
        raise ValueError("a signature length is not an int of at least -1")
    out: list[Any] = []
    append = out.append
    at = 0
    for n in lengths:
        if n < 0:
            append(None)
        else:
            end = at + n
            append(tuple(flat[at:end]))
            at = end
    if at != len(flat):
        raise ValueError("signature lengths do not add up to the items")
    return out


def _exact(kind: type) -> Callable[[Any], Any]:
    return lambda v: v if type(v) is kind else _wrong(kind.__name__, v)




def _any(v: Any) -> Any:
    """An ``Any`` value back as it was encoded: lists become tuples (signatures are tuples)."""
    if type(v) is list:
        if _SCALARS.issuperset(map(type, v)):
            return tuple(v)
        return tuple(map(_any, v))
    if type(v) is dict:
        raise ValueError("an object where a plain value was expected")
    return v


def _wrong(expected: str, value: Any) -> Any:
    raise ValueError(f"expected {expected}, got {type(value).__name__}")
