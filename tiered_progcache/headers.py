"""Header digests: the ``extra_digest`` that makes compiles with include paths cacheable.

cuda-core refuses to key a compile that reads files it cannot see (``include_path``,
``pre_include``, PCH options, an ``options.name`` with a directory, NVVM
``use_libdevice``) unless the caller fingerprints those files. This module does it:
it follows the ``#include`` graph from the source through the directories NVRTC
searches and hashes the *content* of every header the compile could read.

What cuda-core's key already covers is left out on purpose: the source text, the
option strings (so the include directories' names), the compiler version. We add
only file contents, plus the names of includes found nowhere (NVRTC's built-in
headers), so a header that appears later on the path changes the key.

Over-approximation, never under: ``#if`` is ignored (both branches count), a
quoted include counts every candidate on the search path (not only the first),
``__has_include`` counts like an include, and a computed ``#include MACRO``
hashes every file under the directories it could resolve against.

Search rules (checked against NVRTC 13): ``"x"`` is looked up in the including
file's directory, then the include path; ``<x>`` only on the include path; the
main source's directory is ``dirname(options.name)``, or the working directory
when the name has none (unless ``no_source_include``).

Cost: file digests are memoized by ``(path, inode, size, mtime_ns, ctime_ns)``, and
a whole scan is memoized with the list of paths it probed; a warm call re-stats
those paths (about a microsecond each) and hashes nothing. A file modified in the
last ``RACY_NS`` is hashed on every call: two edits within one coarse clock tick
can leave its stat unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Union

__all__ = ["clear_memo", "files_hashed", "header_digest", "needs_header_digest"]

logger = logging.getLogger(__name__)

_DIGEST_VERSION = b"tiered-progcache/headers/1"

# ``#include "x"``, ``#include <x>``, ``#include_next``, ``#import`` and a computed
# ``#include MACRO``; line-anchored, so ``// #include`` is not one (a commented-out
# block is, which only over-approximates).
_DIRECTIVE_RE = re.compile(
    rb'^[ \t]*#[ \t]*(?:include_next|include|import)[ \t]*(?:"([^"\r\n]+)"|<([^>\r\n]+)>|([A-Za-z_]\w*))',
    re.MULTILINE,
)
_HAS_INCLUDE_RE = re.compile(rb'__has_include(?:_next)?[ \t]*\([ \t]*(?:"([^"\r\n]+)"|<([^>\r\n]+)>)')

_QUOTE, _ANGLE, _COMPUTED = 0, 1, 2

#: Files whose digest this process remembers; past this the memo is dropped and rebuilt.
MAX_MEMO_FILES = 200_000
#: Whole scans remembered (one per distinct source and search configuration).
MAX_MEMO_SCANS = 4096

Signature = Union[tuple[Any, ...], None]

#: A file changed this recently (ns) may change again within one coarse clock tick
#: without its signature changing ("racy git"): it is hashed again on every call.
RACY_NS = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class _FileInfo:
    digest: bytes
    includes: tuple[tuple[int, str], ...]


@dataclasses.dataclass
class _ScanResult:
    digest: bytes
    read_anything: bool
    checks: tuple[tuple[str, Signature], ...]
    checked_at: float  # time.monotonic() of the last full re-stat


_file_memo: dict[str, tuple[Signature, _FileInfo]] = {}
_scan_memo: dict[tuple[Any, ...], _ScanResult] = {}
_memo_lock = threading.Lock()
_files_hashed = 0  # files read and hashed by this process (memo misses), for tests and benchmarks


def _signature(path: str) -> Signature:
    """What a later stat must match for a memoized answer about ``path`` to stand."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return ("error", type(exc).__name__)
    if stat.S_ISREG(st.st_mode):
        return ("f", st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if stat.S_ISDIR(st.st_mode):
        return ("d", st.st_ino, st.st_mtime_ns)
    return ("o", st.st_mode)


def _unchanged(checks: tuple[tuple[str, Signature], ...]) -> bool:
    """True if every path still stats as it did: the hot loop of a warm call, kept tight."""
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
        elif _signature(path) != sig:
            return False
    return True


def _parse_includes(data: bytes) -> tuple[tuple[int, str], ...]:
    found: list[tuple[int, str]] = []
    for m in _DIRECTIVE_RE.finditer(data):
        quoted, angled, macro = m.groups()
        if quoted is not None:
            found.append((_QUOTE, quoted.decode("utf-8", "surrogateescape")))
        elif angled is not None:
            found.append((_ANGLE, angled.decode("utf-8", "surrogateescape")))
        else:
            found.append((_COMPUTED, macro.decode("utf-8", "surrogateescape")))
    for m in _HAS_INCLUDE_RE.finditer(data):
        quoted, angled = m.groups()
        if quoted is not None:
            found.append((_QUOTE, quoted.decode("utf-8", "surrogateescape")))
        else:
            found.append((_ANGLE, angled.decode("utf-8", "surrogateescape")))
    return tuple(found)


def _is_racy(sig: Signature) -> bool:
    """Modified within RACY_NS of now (by mtime, as git does): a stat cannot vouch for it yet."""
    if sig is None:
        return False
    if sig[0] == "f":
        return sig[3] > time.time_ns() - RACY_NS
    if sig[0] == "d":
        return sig[2] > time.time_ns() - RACY_NS
    return False


def _count_hashed() -> None:
    global _files_hashed
    _files_hashed += 1


def _file_info(path: str, sig: Signature) -> _FileInfo | None:
    """Digest and include list of a regular file, memoized by its stat signature."""
    if sig is None or sig[0] != "f":
        return None
    cached = _file_memo.get(path)
    if cached is not None and cached[0] == sig:
        return cached[1]
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    _count_hashed()
    info = _FileInfo(hashlib.sha256(data, usedforsecurity=False).digest(), _parse_includes(data))
    after = _signature(path)
    if after == sig and not _is_racy(sig):  # settled and not rewritten while we read it
        with _memo_lock:
            if len(_file_memo) >= MAX_MEMO_FILES:
                _file_memo.clear()
            _file_memo[path] = (sig, info)
    return info


class _Scan:
    """One walk of the include graph, collecting the digest stream and the paths probed."""

    def __init__(self, include_dirs: Sequence[str]) -> None:
        self.include_dirs = tuple(include_dirs)
        self.hasher = hashlib.sha256(_DIGEST_VERSION, usedforsecurity=False)
        self.checks: dict[str, Signature] = {}
        self.visited: set[str] = set()
        self.queue: list[tuple[str, str | None, tuple[tuple[int, str], ...]]] = []
        self.fallback_dirs: dict[str, str] = {}
        self.read_anything = False
        self.racy = False  # something changed too recently to trust a stat next time

    def emit(self, label: str, payload: bytes) -> None:
        self.hasher.update(label.encode("ascii"))
        self.hasher.update(len(payload).to_bytes(8, "big"))
        self.hasher.update(payload)

    def probe(self, path: str) -> Signature:
        if path in self.checks:
            return self.checks[path]
        sig = self.checks[path] = _signature(path)
        if _is_racy(sig):
            self.racy = True
        return sig

    def dir_tag(self, directory: str) -> str:
        """How a directory is named in the digest: by include-path index, else relative to one."""
        for i, d in enumerate(self.include_dirs):
            if directory == d:
                return f"I{i}"
        for i, d in enumerate(self.include_dirs):
            if directory.startswith(d.rstrip(os.sep) + os.sep):
                return f"I{i}:{os.path.relpath(directory, d)}"
        return directory

    def add_file(self, label: str, path: str, own_dir: str | None) -> bool:
        """Hash ``path`` if it is a readable file, and queue its includes; False if absent."""
        sig = self.probe(path)
        info = _file_info(path, sig)
        if info is None:
            return False
        self.read_anything = True
        self.emit(label, info.digest)
        if path not in self.visited:
            self.visited.add(path)
            self.queue.append((path, own_dir, info.includes))
        return True

    def resolve(self, kind: int, spelling: str, includer_dir: str | None, includer_tag: str) -> None:
        self.emit("include", f"{kind}:{spelling}".encode("utf-8", "surrogateescape"))
        if os.path.isabs(spelling):
            if not self.add_file("abs", os.path.normpath(spelling), os.path.dirname(os.path.normpath(spelling))):
                self.emit("missing", b"")
            return
        candidates: list[tuple[str, str]] = []
        if kind == _QUOTE and includer_dir is not None:
            candidates.append((includer_tag, includer_dir))
        candidates.extend((f"I{i}", d) for i, d in enumerate(self.include_dirs))
        found = False
        for tag, directory in candidates:
            path = os.path.normpath(os.path.join(directory, spelling))
            if self.add_file(f"found:{tag}", path, os.path.dirname(path)):
                found = True
        if not found:
            # A built-in NVRTC header or one the compile will fail on: keyed by name only.
            self.emit("missing", b"")

    def computed(self, includer_dir: str | None) -> None:
        """``#include MACRO``: anything in the directories it could resolve against may be read."""
        self.emit("computed", b"")
        if includer_dir is not None:
            self.fallback_dirs.setdefault(includer_dir, self.dir_tag(includer_dir))
        for i, d in enumerate(self.include_dirs):
            self.fallback_dirs.setdefault(d, f"I{i}")

    def drain(self) -> None:
        while self.queue:
            path, own_dir, includes = self.queue.pop(0)
            tag = self.dir_tag(own_dir) if own_dir is not None else ""
            for kind, spelling in includes:
                if kind == _COMPUTED:
                    self.computed(own_dir)
                else:
                    self.resolve(kind, spelling, own_dir, f"cur:{tag}")

    def hash_fallback_dirs(self) -> None:
        for directory, tag in sorted(self.fallback_dirs.items(), key=lambda item: item[1]):
            self.emit("tree", tag.encode("utf-8", "surrogateescape"))
            for path in _walk_files(directory, self):
                info = _file_info(path, self.checks[path])
                if info is not None:
                    self.read_anything = True
                    rel = os.path.relpath(path, directory).encode("utf-8", "surrogateescape")
                    self.emit("tree-file", rel + b"\0" + info.digest)


def _walk_files(directory: str, scan: _Scan) -> Iterable[str]:
    """Regular files under ``directory`` in a stable order; each directory's mtime is checked later."""
    scan.probe(directory)
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for d in dirs:
            scan.probe(os.path.join(root, d))
        for name in sorted(files):
            path = os.path.join(root, name)
            scan.probe(path)
            yield path


def _as_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    if isinstance(value, Sequence):
        return [os.fspath(v) for v in value]
    return []


def _hashable(value: object) -> object:
    if value is None or type(value) is str:
        return value
    try:
        if isinstance(value, (list, tuple)):
            return tuple(map(os.fspath, value))
        return os.fspath(value)  # type: ignore[arg-type]
    except TypeError:
        return repr(value)


def _source_dir(options: Any) -> str | None:
    if getattr(options, "no_source_include", False):
        return None
    name = getattr(options, "name", None)
    if isinstance(name, str) and ("/" in name or "\\" in name):
        return os.path.abspath(os.path.dirname(name))
    return os.getcwd()


def needs_header_digest(options: Any, code_type: str = "c++") -> bool:
    """True when cuda-core's key cannot be built without an ``extra_digest`` for ``options``.

    Mirrors cuda-core's guard (``make_program_cache_key``); pure, safe from any thread.

    >>> needs_header_digest(ProgramOptions(arch="sm_90", include_path=["inc"]))
    True
    """
    code_type = code_type.lower()
    if code_type == "nvvm":
        return bool(getattr(options, "use_libdevice", None))
    if code_type != "c++":
        return False
    if _as_list(getattr(options, "include_path", None)) or _as_list(getattr(options, "pre_include", None)):
        return True
    if getattr(options, "pch", None) or any(
        getattr(options, name, None) is not None for name in ("use_pch", "pch_dir")
    ):
        return True
    name = getattr(options, "name", None)
    return isinstance(name, str) and ("/" in name or "\\" in name)


def _libdevice_digest() -> bytes:
    # cuda.pathfinder's public finder: the same file cuda-core's NVVM path links in.
    from cuda.pathfinder import find_bitcode_lib

    path = os.fspath(find_bitcode_lib("device"))
    info = _file_info(path, _signature(path))
    if info is None:
        raise FileNotFoundError(f"libdevice not readable at {path}")
    return hashlib.sha256(_DIGEST_VERSION + b"\0libdevice\0" + info.digest, usedforsecurity=False).digest()


def header_digest(
    source: str | bytes, options: Any, code_type: str = "c++", *, recheck_s: float = 0.0
) -> bytes | None:
    """The ``extra_digest`` covering every file the compile of ``source`` could read, or None.

    None means the compile reads no file beyond the source (no include path, no
    pre-include, no quoted include found next to the source), so the key is the one
    ``Program.compile(cache=...)`` would use and entries are shared with it.

    >>> opts = ProgramOptions(arch="sm_90", include_path=[cccl_dir])
    >>> key = make_program_cache_key(code=src, code_type="c++", options=opts,
    ...                              target_type="cubin", extra_digest=header_digest(src, opts))

    ``recheck_s``: trust a scan this process already validated for that many seconds
    without re-statting its files (0, the default: re-stat on every call, so an
    edited header is seen at once; the stat costs about a microsecond per header).

    Thread-safe and process-safe: it only reads files; the memo is per process and
    a racing writer at worst causes a rehash. The working directory and include
    directories are read at call time (relative include paths follow ``os.getcwd()``).
    """
    code_type = code_type.lower()
    if code_type == "nvvm":
        return _libdevice_digest() if getattr(options, "use_libdevice", None) else None
    if code_type != "c++":
        return None  # PTX: the linker reads no headers; cuda-core drops include options there

    if (isinstance(source, str) and "include" not in source and "import" not in source
            and not needs_header_digest(options, code_type)):
        return None  # no directive can read a file (the common case, kept cheap)
    if not isinstance(source, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"source must be str or bytes, got {type(source).__name__}")

    # The memo key is made of what the caller passed, unresolved (cheap to hash: a str
    # caches its hash); the working directory joins it because relative paths follow it.
    memo_key = (
        source if isinstance(source, (str, bytes)) else bytes(source),
        _hashable(getattr(options, "include_path", None)),
        _hashable(getattr(options, "pre_include", None)),
        getattr(options, "name", None),
        bool(getattr(options, "no_source_include", False)),
        _hashable(getattr(options, "use_pch", None)),
        os.getcwd(),
    )
    cached = _scan_memo.get(memo_key)
    if cached is not None:
        now = time.monotonic()
        fresh = recheck_s > 0 and now - cached.checked_at < recheck_s
        if not fresh and _unchanged(cached.checks):
            cached.checked_at = now
            fresh = True
        if fresh:
            return cached.digest if cached.read_anything or needs_header_digest(options, code_type) else None

    data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else bytes(source)
    include_dirs = tuple(os.path.abspath(p) for p in _as_list(getattr(options, "include_path", None)))
    pre_includes = tuple(_as_list(getattr(options, "pre_include", None)))
    source_dir = _source_dir(options)
    use_pch = getattr(options, "use_pch", None)
    use_pch_path = os.path.abspath(os.fspath(use_pch)) if isinstance(use_pch, (str, os.PathLike)) else None

    scan = _Scan(include_dirs)
    for spelling in pre_includes:
        scan.resolve(_QUOTE, spelling, source_dir, "source")
    for kind, spelling in _parse_includes(data):
        if kind == _COMPUTED:
            scan.emit("computed", b"")
            if source_dir is not None:
                scan.fallback_dirs.setdefault(source_dir, "source")
            for i, d in enumerate(include_dirs):
                scan.fallback_dirs.setdefault(d, f"I{i}")
        else:
            scan.resolve(kind, spelling, source_dir, "source")
    scan.drain()
    scan.hash_fallback_dirs()
    if use_pch_path is not None and not scan.add_file("use_pch", use_pch_path, None):
        scan.emit("use_pch-missing", b"")
    digest = scan.hasher.digest()
    read_anything = scan.read_anything or bool(scan.fallback_dirs)

    with _memo_lock:
        if len(_scan_memo) >= MAX_MEMO_SCANS:
            _scan_memo.clear()
        if scan.racy:
            _scan_memo.pop(memo_key, None)
        else:
            _scan_memo[memo_key] = _ScanResult(digest, read_anything, tuple(scan.checks.items()), time.monotonic())
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("header scan: %d files read, %d paths probed, %d directory fallbacks",
                     len(scan.visited), len(scan.checks), len(scan.fallback_dirs))
    return digest if read_anything or needs_header_digest(options, code_type) else None


def files_hashed() -> int:
    """Header files this process has read and hashed so far (each memo miss counts one).

    Per process; read without a lock (a racing thread's count may show up a call late).
    """
    return _files_hashed


def clear_memo() -> None:
    """Forget every memoized file and scan (tests, or after remounting a header tree). Thread-safe."""
    with _memo_lock:
        _file_memo.clear()
        _scan_memo.clear()
