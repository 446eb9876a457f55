"""What this process remembers of header scans, and when a stat or inotify vouches for it.

:mod:`.headerscan` walks the include graph; this module keeps what the walk found so a warm
call reads nothing. File digests are memoized by ``(path, inode, size, mtime_ns,
ctime_ns)`` (:func:`signature`), and a whole scan (:class:`ScanResult`) with the list of
paths it probed. A warm call asks :mod:`.headerwatch` whether inotify saw anything the scan
depends on change (one ``poll(2)``, no stat); where inotify is unavailable or not trusted
(a network filesystem) it re-stats those paths instead (about a microsecond each). Either
way it hashes nothing. Before inotify vouches for a scan it is validated by stat once: at
its second use in the process, after an event on something it depends on, and when it is
loaded from disk (then by stat alone). A file modified in the last ``RACY_NS`` is hashed
on every call: two edits within one coarse clock tick can leave its stat unchanged.

Across processes: with ``memo_dir`` (``compile()`` passes the local cache directory's
``header-scans/``) a scan is persisted by :mod:`.scanmemo`, and a new process loads and
validates it instead of scanning again. A scan that :mod:`.direct` verified from a
manifest is persisted too, at exit (:func:`persist_at_exit`): not on the hit's path.

Bounds: :data:`MAX_MEMO_FILES` files and :data:`MAX_MEMO_SCANS` scans,
least recently used forgotten first (``cachetools``; an evicted scan's watch released).
Thread-safe: the memos change under one lock (made anew in a forked child); the counters
behind :func:`validation_counts` and :func:`files_hashed` are read without it.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Union

import cachetools

from .. import forks
from . import headerwatch, scanmemo
from .headerwatch import Subscription

__all__ = [
    "MAX_MEMO_FILES",
    "MAX_MEMO_SCANS",
    "RACY_NS",
    "FileInfo",
    "HeaderFile",
    "ScanResult",
    "Signature",
    "ValidationCounts",
    "clear_memo",
    "files_hashed",
    "is_racy",
    "known_file",
    "memoize",
    "memoized",
    "persist_at_exit",
    "register_scanner",
    "remember_file",
    "resolve",
    "scan_document",
    "scan_from_document",
    "signature",
    "signature_of_stat",
    "validation_counts",
]


#: Files whose digest this process remembers; past this the least recently used is forgotten.
MAX_MEMO_FILES = 200_000
#: Whole scans remembered (one per distinct source and search configuration).
MAX_MEMO_SCANS = 4096

Signature = Union[tuple[Any, ...], None]

#: A file changed this recently (ns) may change again within one coarse clock tick
#: without its signature changing ("racy git"): it is hashed again on every call.
RACY_NS = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """A file's sha256 and the includes :func:`.headerlex.parse_includes` found in it (none if not parsed)."""

    digest: bytes
    includes: tuple[tuple[int, str], ...]


class HeaderFile(NamedTuple):
    """One file a compile can read, named by where the compiler finds it, not where it lives. Immutable.

    ``root`` is the role of the root it lies under: ``"I0"``, ``"I1"``, ... (the include
    path, by position), ``"source"`` (the source's directory), ``"cwd"`` (the working directory,
    where a relative ``pre_include`` is found, when it is not the source's), ``"use_pch"`` (the PCH file
    ``use_pch`` names; ``path`` is its basename), ``"libdevice"`` (NVVM), or ``"abs"``
    (under no root: ``path`` is then absolute, and the key is not portable).
    ``path`` is relative to the root, '/'-separated; ``digest`` the sha256 hex of its bytes.
    A tuple: a CUB scan holds 600, read back from disk at a fresh process's first hit.
    """

    root: str
    path: str
    digest: str


@dataclasses.dataclass
class ScanResult:
    """One scan, persisted by :func:`scan_document`; ``checked_at`` and the fields after ``textual`` are per process."""

    digest: bytes
    read_anything: bool
    checks: tuple[tuple[str, Signature], ...]
    real_checks: tuple[tuple[str, str], ...]  # directory -> where the OS took it
    checked_at: float  # time.monotonic() of the last full re-stat
    headers: tuple[HeaderFile, ...]  # every file covered, sorted
    missing: tuple[str, ...]  # include spellings found nowhere, sorted
    path_free: bool  # the digest and every file's name are free of absolute paths
    declined: Union[str, None]  # why the compile cannot be keyed (HeaderScan.declined), or None
    #: every path probed was built from a root (include, source or working directory) or a real directory
    #: recorded in ``real_checks``: the same probes under other roots (what a direct-mode set may record)
    relocatable: bool = False
    #: ``(normpath, path)`` of each ``..`` include candidate also probed as text: how ``normpath`` was made
    textual: tuple[tuple[str, str], ...] = ()
    #: inotify's word that nothing in ``checks`` changed since that re-stat (None: re-stat on the next call)
    watch: Subscription | None = dataclasses.field(default=None, compare=False, repr=False, kw_only=True)
    #: validations by stat in this process (the scan itself counts one): watched from the second on
    validations: int = dataclasses.field(default=1, compare=False, kw_only=True)


_DOCUMENT_FIELDS = frozenset({"digest", "read_anything", "paths", "signatures", "real_checks", "headers", "missing",
                              "path_free", "declined", "relocatable", "textual"})


def scan_document(result: ScanResult) -> dict[str, Any]:
    """``result`` as the JSON document :mod:`.scanmemo` persists: rows of a fixed shape by columns, and the
    signatures as their lengths (-1: None) and their items flat, for a tenth of the JSON values a list per row takes."""
    lengths: list[int] = []
    items: list[Any] = []
    for _, sig in result.checks:
        lengths.append(-1 if sig is None else len(sig))
        items.extend(sig or ())
    return {"digest": result.digest.hex(), "read_anything": result.read_anything,
            "paths": [path for path, _ in result.checks], "signatures": [lengths, items],
            "real_checks": _columns(result.real_checks, 2), "headers": _columns(result.headers, 3),
            "missing": list(result.missing), "path_free": result.path_free, "declined": result.declined,
            "relocatable": result.relocatable, "textual": _columns(result.textual, 2)}


def scan_from_document(doc: Any) -> ScanResult:
    """The scan :func:`scan_document` wrote, never yet validated (``checked_at`` 0, no validation counted);
    ValueError for anything that is not exactly that shape."""
    if type(doc) is not dict or doc.keys() != _DOCUMENT_FIELDS:
        got = sorted(doc) if type(doc) is dict else type(doc).__name__
        raise ValueError(f"the fields of a scan expected, got {got}")
    paths = _strings(doc["paths"])
    declined = doc["declined"]
    if declined is not None and type(declined) is not str:
        raise ValueError("declined is neither a string nor null")
    return ScanResult(bytes.fromhex(_string(doc["digest"])), _flag(doc["read_anything"]),
                      tuple(zip(paths, _signatures(doc["signatures"], len(paths)))), _rows(doc["real_checks"], 2), 0.0,
                      _rows(doc["headers"], 3, HeaderFile), tuple(_strings(doc["missing"])), _flag(doc["path_free"]),
                      declined, _flag(doc["relocatable"]), _rows(doc["textual"], 2), validations=0)


def _columns(rows: tuple[tuple[str, ...], ...], width: int) -> list[list[str]]:
    return [list(column) for column in zip(*rows)] if rows else [[] for _ in range(width)]


def _rows(columns: Any, width: int, row: Callable[..., Any] | None = None) -> tuple[Any, ...]:
    """Columns of strings back to rows: tuples, or ``row(*values)`` of each."""
    if type(columns) is not list or len(columns) != width:
        raise ValueError(f"{width} columns expected")
    values = [_strings(column) for column in columns]
    if len({len(column) for column in values}) != 1:
        raise ValueError("columns of different lengths")
    return tuple(zip(*values) if row is None else map(row, *values))


def _strings(value: Any) -> list[str]:
    if type(value) is not list or not {str}.issuperset(map(type, value)):
        raise ValueError("a list of strings expected")
    return value


def _string(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"a string expected, got {type(value).__name__}")
    return value


def _flag(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"true or false expected, got {type(value).__name__}")
    return value


def _signatures(value: Any, count: int) -> list[Signature]:
    """``[lengths, items]`` back to None (-1) or tuples of strings and ints."""
    if type(value) is not list or len(value) != 2:
        raise ValueError("[lengths, items] expected")
    lengths, items = value
    if type(lengths) is not list or len(lengths) != count or type(items) is not list:
        raise ValueError(f"{count} lengths and a list of items expected")
    if not {int}.issuperset(map(type, lengths)) or min(lengths, default=0) < -1:
        raise ValueError("a signature length is not an int of at least -1")
    if not {str, int}.issuperset(map(type, items)):
        raise ValueError("a signature holds strings and ints only")
    out: list[Signature] = []
    at = 0
    for n in lengths:
        if n < 0:
            out.append(None)
        else:
            out.append(tuple(items[at:at + n]))
            at += n
    if at != len(items):
        raise ValueError("signature lengths do not add up to the items")
    return out


@dataclasses.dataclass(frozen=True)
class ValidationCounts:
    """How this process's warm ``header_digest`` calls were validated (tests and benchmarks prove a path with it).

    ``by_stat``: memos validated by a stat of every path they probed (the first
    validation of a memo, one after an event on something it depends on, every call
    where no watch can be had); ``by_watch``: calls answered on inotify's word;
    ``paths_statted``: paths those validations stat'ed in all.
    """

    by_stat: int
    by_watch: int
    paths_statted: int


class _ScanLRU(cachetools.LRUCache):  # type: ignore[type-arg]
    """The scan memo: an LRU whose evicted scan releases its watch."""

    def popitem(self) -> tuple[Any, ScanResult]:
        key, result = super().popitem()
        if result.watch is not None:
            result.watch.release()
        return key, result


# path -> (signature, info, parsed); LRUs (reads reorder them), so read and written under _memo_lock
_file_memo: cachetools.LRUCache[str, tuple[Signature, FileInfo, bool]] = cachetools.LRUCache(MAX_MEMO_FILES)
_scan_memo: _ScanLRU = _ScanLRU(MAX_MEMO_SCANS)
#: scans to persist at exit: memo key -> (result, memo_dir)
_at_exit: cachetools.LRUCache[tuple[Any, ...], tuple[ScanResult, str]] = cachetools.LRUCache(MAX_MEMO_SCANS)
_memo_lock = threading.Lock()
_files_hashed = 0  # files read and hashed by this process (memo misses), for tests and benchmarks
_by_stat = _by_watch = _paths_statted = 0  # see ValidationCounts
_memo_stores: dict[str, scanmemo.ScanMemoStore] = {}


def signature(path: str) -> Signature:
    """What a later stat must match for a memoized answer about ``path`` to stand."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return ("error", type(exc).__name__)
    return signature_of_stat(st)


def signature_of_stat(st: os.stat_result) -> Signature:
    if stat.S_ISREG(st.st_mode):
        return ("f", st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if stat.S_ISDIR(st.st_mode):
        # ctime too: ``cp -p``, ``rsync -t`` and ``tar x`` put a directory's mtime back after adding a file
        return ("d", st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    return ("o", st.st_mode)


def _unchanged(checks: tuple[tuple[str, Signature], ...]) -> bool:
    """True if every path still stats as it did: the hot loop of a warm call, kept tight."""
    global _paths_statted
    _paths_statted += len(checks)
    stat_ = os.stat
    for path, sig in checks:
        if sig is not None and sig[0] == "f":
            try:
                st = stat_(path)
            except OSError:
                return False
            if (st.st_mtime_ns != sig[3] or st.st_size != sig[2] or st.st_ino != sig[1]
                    or st.st_ctime_ns != sig[4] or not stat.S_ISREG(st.st_mode)):
                return False
        elif signature(path) != sig:
            return False
    return True


def _same_realpaths(real_checks: tuple[tuple[str, str], ...]) -> bool:
    """True if every directory still resolves where it did (no symlink on the way was retargeted)."""
    resolved: dict[str, str] = {"/": "/"}
    return all(resolve(directory, resolved) == real for directory, real in real_checks)


def resolve(path: str, resolved: dict[str, str]) -> str:
    """Exactly ``os.path.realpath(path)``, at one ``lstat`` per component not seen before: ``resolved``
    (start it as ``{"/": "/"}``) keeps the real path of each directory on the way, shared by the paths
    resolved with it. A component that is a symbolic link is resolved by ``realpath`` from its real parent."""
    found = resolved.get(path)
    if found is not None:
        return found
    if not _is_plain_absolute(path):
        return os.path.realpath(path)
    parent, _, name = path.rpartition("/")
    real_parent = resolve(parent or "/", resolved)
    candidate = os.path.join(real_parent, name)
    try:
        is_link = stat.S_ISLNK(os.lstat(candidate).st_mode)
    except OSError:
        is_link = False  # as realpath: a component it cannot lstat is taken as it is
    found = resolved[path] = os.path.realpath(candidate) if is_link else candidate
    return found


def _is_plain_absolute(path: str) -> bool:
    """Absolute, normalized, and not ``//``-rooted: the form whose real path is its parent's and its name's."""
    return path.startswith("/") and not path.startswith("//") and os.path.normpath(path) == path


def is_racy(sig: Signature) -> bool:
    """Modified within RACY_NS of now (by mtime, as git does): a stat cannot vouch for it yet."""
    if sig is None:
        return False
    if sig[0] == "f":
        return sig[3] > time.time_ns() - RACY_NS
    if sig[0] == "d":
        return sig[2] > time.time_ns() - RACY_NS
    return False


def known_file(path: str, sig: Signature, *, parse: bool) -> FileInfo | None:
    """The memoized digest of ``path`` if ``sig`` is still its signature (with its includes, if ``parse``)."""
    with _memo_lock:
        cached = _file_memo.get(path)
    if cached is not None and cached[0] == sig and (cached[2] or not parse):
        return cached[1]
    return None


def remember_file(path: str, sig: Signature, info: FileInfo, *, parse: bool, after: Signature) -> None:
    """A file just read and hashed: counted (:func:`files_hashed`), and memoized if it settled.

    Settled: not changed while it was read (``after``, the signature of the descriptor read, is
    still ``sig``) and not modified within ``RACY_NS``. ``parse`` False: ``info`` has no includes;
    a later parse reads it again.
    """
    global _files_hashed
    _files_hashed += 1
    if after == sig and not is_racy(sig):  # settled and not rewritten while we read it
        with _memo_lock:
            _file_memo[path] = (sig, info, parse)


def memoized(
    memo_key: tuple[Any, ...], recheck_s: float, memo_dir: str | os.PathLike[str] | None,
    scanner_id: Callable[[], bytes | None],
) -> ScanResult | None:
    """The scan memoized for ``memo_key`` if it still stands, else None (scan again).

    In this process: on inotify's word (plus a stat of what no watch covers), within
    ``recheck_s`` of its last validation, or after validating it again. Else, from
    ``memo_dir``: a scan an earlier process persisted under ``scanner_id()`` (the scanner's
    code, asked only then; None: nothing is persisted), validated by stat before use.
    """
    global _by_watch
    with _memo_lock:
        cached = _scan_memo.get(memo_key)
    if cached is not None:
        watch = cached.watch
        if watch is not None and watch.current() and _unwatched_unchanged(watch):
            _by_watch += 1
            return cached
        if watch is not None and watch.rescan:
            return None  # a file appeared or went in a directory walked whole: scan it again
        if (recheck_s > 0 and time.monotonic() - cached.checked_at < recheck_s) or _revalidate(cached):
            return cached
        return None
    found = _persisted(memo_key, memo_dir, scanner_id)
    if found is None:
        return None
    store, name = found
    loaded = store.load(name, scan_from_document)
    if loaded is None or not _revalidate(loaded):
        return None
    _remember(memo_key, loaded)
    return loaded


def memoize(
    memo_key: tuple[Any, ...], result: ScanResult | None, memo_dir: str | os.PathLike[str] | None,
    scanner_id: Callable[[], bytes | None],
) -> None:
    """Remember a fresh scan here and in ``memo_dir``; None (a racy scan) forgets ``memo_key`` instead."""
    if result is None:
        _forget(memo_key)
        return
    _remember(memo_key, result)
    found = _persisted(memo_key, memo_dir, scanner_id)
    if found is not None:
        store, name = found
        store.save(name, scan_document(result))


def persist_at_exit(memo_key: tuple[Any, ...], result: ScanResult, memo_dir: str | os.PathLike[str] | None) -> None:
    """Remember a scan here now and persist it in ``memo_dir`` when the process exits (a verified
    direct-mode set: its hit does not pay the write; a process killed first only costs the next one that check)."""
    _remember(memo_key, result)
    if memo_dir is not None:
        with _memo_lock:
            _at_exit[memo_key] = (result, os.fspath(memo_dir))


def _persist_pending(scanner_id: Callable[[], bytes | None]) -> None:
    """Persist the scans :func:`persist_at_exit` kept whose local cache directory is still there."""
    with _memo_lock:
        pending = list(_at_exit.items())
        _at_exit.clear()
    for memo_key, (result, memo_dir) in pending:
        if os.path.isdir(os.path.dirname(os.path.abspath(memo_dir))):
            found = _persisted(memo_key, memo_dir, scanner_id)
            if found is not None:
                found[0].save(found[1], scan_document(result))


def register_scanner(scanner_id: Callable[[], bytes | None]) -> None:
    """Have the scans kept for exit persisted under ``scanner_id()`` (:mod:`.headerscan` registers its own)."""
    atexit.register(_persist_pending, scanner_id)


def _persisted(
    memo_key: tuple[Any, ...], memo_dir: str | os.PathLike[str] | None, scanner_id: Callable[[], bytes | None]
) -> tuple[scanmemo.ScanMemoStore, str] | None:
    """The store and file name ``memo_key`` persists under, or None (no ``memo_dir``, or no scanner id)."""
    if memo_dir is None:
        return None
    code_id = scanner_id()
    if code_id is None:
        return None
    key = os.fspath(memo_dir)
    store = _memo_stores.get(key)
    if store is None:
        store = _memo_stores.setdefault(key, scanmemo.ScanMemoStore(key))
    return store, scanmemo.memo_name(memo_key, code_id)


def _unwatched_unchanged(watch: Subscription) -> bool:
    """The paths no watch covers (an untrusted filesystem, a refused watch), re-stat'ed on every call."""
    return (not watch.stat_checks or _unchanged(watch.stat_checks)) and (
        not watch.stat_real_checks or _same_realpaths(watch.stat_real_checks)
    )


def _revalidate(result: ScanResult) -> bool:
    """Validate ``result`` by stat; from its second use on, where inotify can be had, watch first,
    so that this stat is the last one.

    False if anything differs, or if a header is too fresh to vouch for by stat (RACY_NS).
    """
    global _by_stat, _paths_statted
    previous, result.watch = result.watch, None
    if previous is not None:
        previous.release()
    with _memo_lock:
        _by_stat += 1
    deadline = time.time_ns() - RACY_NS
    for _, sig in result.checks:
        if sig is not None and sig[0] in ("f", "d") and sig[3 if sig[0] == "f" else 2] > deadline:
            return False
    # Watched from the second use on: a process that uses a scan once (a script compiling
    # each kernel once, the first call after a load) pays one stat pass, not a watch setup.
    watcher = headerwatch.watcher() if result.validations > 0 else None
    result.validations += 1
    if watcher is None:
        valid = _unchanged(result.checks) and _same_realpaths(result.real_checks)
    else:
        _paths_statted += len(result.checks)
        sub = watcher.subscribe(result.checks, result.real_checks,
                                signature=signature, signature_of_stat=signature_of_stat)
        valid = sub.valid
        if valid:
            with _memo_lock:
                raced, result.watch = result.watch, sub  # another thread validating the same scan at once
            if raced is not None:
                raced.release()
    if valid:
        result.checked_at = time.monotonic()
    return valid


def _remember(memo_key: tuple[Any, ...], result: ScanResult) -> None:
    with _memo_lock:
        previous = _scan_memo.get(memo_key)
        _scan_memo[memo_key] = result  # past MAX_MEMO_SCANS the least recently used goes (its watch released)
    if previous is not None and previous is not result and previous.watch is not None:
        previous.watch.release()


def _forget(memo_key: tuple[Any, ...]) -> None:
    with _memo_lock:
        previous = _scan_memo.pop(memo_key, None)
    if previous is not None and previous.watch is not None:
        previous.watch.release()


def _release_all() -> None:
    """Drop every scan (memo lock held); the LRU's eviction releases their watches."""
    _scan_memo.clear()


def _new_lock_after_fork() -> None:
    global _memo_lock
    _memo_lock = threading.Lock()  # another thread may have held it at the fork


forks.register(_new_lock_after_fork)


def validation_counts() -> ValidationCounts:
    """This process's validations of warm header memos so far (see :class:`ValidationCounts`)."""
    return ValidationCounts(_by_stat, _by_watch, _paths_statted)


def files_hashed() -> int:
    """Header files this process has read and hashed so far (each memo miss counts one).

    Per process; read without a lock (a racing thread's count may show up a call late).
    """
    return _files_hashed


def clear_memo() -> None:
    """Forget every memoized file and scan (tests, or after remounting a header tree). Thread-safe."""
    with _memo_lock:
        _file_memo.clear()
        _at_exit.clear()
        _release_all()
