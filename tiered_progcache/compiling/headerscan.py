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
``__has_include`` counts like an include. A computed ``#include MACRO`` (and
``__has_include(MACRO)``, and a call of a ``__has_include`` wrapper such as CCCL's
``_CCCL_HAS_INCLUDE(<x>)`` on an ``#if``/``#elif``/``#define`` line) is resolved through
every definition of the macro the scan has seen (object-like, nested, ``-D``): all of
them count. One it cannot resolve (a function-like macro, ``##``) hashes every file
under the includer's directory and the include path, within ``MAX_WALK_FILES`` /
``MAX_WALK_BYTES``; where that would mean the working directory or ``/``, or past those
bounds, or a header over ``MAX_HEADER_BYTES``, the scan *declines* instead
(``HeaderScan.declined``): ``compile()`` compiles without the cache. Headers are hashed
by streaming; nothing is read whole past the bound.

Search rules (checked against NVRTC 13, docs/reliability.md "Where NVRTC looks for a
header"): ``"x"`` is looked up in the including file's directory, then the include
path (no includer stack); ``<x>`` only on the include path; the main source's directory
is ``dirname(options.name)``, or the working directory when the name has none (unless
``no_source_include``); a relative ``pre_include`` in the working directory, then the
include path (role ``cwd`` where the working directory is not the source's).

Two streams (``portable``): the location-bound digest (:func:`header_digest`, and
``compile(portable_keys=False)``) names a directory outside the include path by its
absolute path. The portable digest (:func:`header_scan`, the default
of ``compile()``) names every directory and absolute spelling by its role, the
include-path position (``I0``, ``I1``, ...) or the source's directory (``source``),
plus the path relative to it, so the same files under another root give the same
digest. What lies under no root keeps its absolute path and the scan says so
(``HeaderScan.path_free`` False). Either scan records the files it read as
:class:`HeaderFile` s, named by role and relative path.

Lexing is :mod:`.headerlex`'s (directives on preprocessor tokens, the macros computed
includes go through); what a warm call may skip, and how a memoized scan is validated
(a stat, or inotify's word) and persisted, is :mod:`.headermemo`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from . import headerlex, headermemo
from .headerlex import (
    ANGLE,
    CALL,
    COMPUTED,
    DEFINE,
    HAS_WRAPPER,
    PRE_INCLUDE,
    QUOTE,
    WRAPS,
    MacroTable,
    names_no_file,
    parse_includes,
)
from .headermemo import (
    FileInfo,
    HeaderFile,
    ScanResult,
    Signature,
    is_racy,
    known_file,
    memoize,
    memoized,
    remember_file,
    signature,
    signature_of_stat,
)
from ..stores.ratelimit import log_once

__all__ = [
    "MAX_HEADER_BYTES",
    "adopt_scan",
    "file_digest",
    "locate",
    "path_list",
    "scan_view",
    "scans_run",
    "MAX_WALK_BYTES",
    "MAX_WALK_FILES",
    "HeaderFile",
    "HeaderScan",
    "header_digest",
    "header_scan",
    "needs_header_digest",
    "path_roles",
    "role_relative",
    "role_token",
]

logger = logging.getLogger(__name__)

_DIGEST_VERSION = b"tiered-progcache/headers/1"
#: The portable stream starts elsewhere: it never equals a location-bound digest.
_PORTABLE_DIGEST_VERSION = b"tiered-progcache/headers/portable/1"

#: Largest header hashed (streamed, never read whole past this): a bigger one declines the compile.
MAX_HEADER_BYTES = 32 << 20
#: Most files, and bytes, an unresolvable computed include's directory walk reads before the compile
#: is declined (never cached) instead: the whole CCCL tree is about 2,000 files and 25 MB.
MAX_WALK_FILES = 20_000
MAX_WALK_BYTES = 256 << 20
_HASH_CHUNK = 1 << 20

#: What _file_info returns for a file over MAX_HEADER_BYTES (the scan then declines the compile).
_TOO_BIG = FileInfo(b"", ())


@dataclasses.dataclass(frozen=True)
class HeaderScan:
    """What :func:`header_scan` found. Immutable.

    ``digest`` is the ``extra_digest`` to mix into the key (None: the compile reads no
    file); ``headers`` every file it covers, sorted; ``missing`` the include spellings
    found nowhere (NVRTC's built-in headers), sorted; ``path_free`` False when the digest
    or a file's name had to keep an absolute path (always False for a location-bound scan).
    ``declined``: why what the compile reads cannot be known within the scanner's bounds (a
    computed include it cannot resolve, whose directories are the working directory or too
    big; a header over ``MAX_HEADER_BYTES``); ``compile()`` then compiles without caching.
    None for a scan that covers everything.
    """

    digest: bytes | None
    headers: tuple[HeaderFile, ...]
    missing: tuple[str, ...]
    path_free: bool
    declined: str | None = None
    #: the memoized scan behind it (what :mod:`.direct` records), None where no file was read
    result: ScanResult | None = dataclasses.field(default=None, compare=False, repr=False)


_NOTHING_READ = {True: HeaderScan(None, (), (), True), False: HeaderScan(None, (), (), False)}  # by ``portable``


def _file_info(path: str, sig: Signature, *, parse: bool = True) -> FileInfo | None:
    """Digest and include list of a regular file, memoized by its stat signature.

    One read of the size ``sig`` gives (and a byte more, to see it grew), then ``fstat`` of the
    same descriptor: a file that still has ``sig`` was read whole and is memoized. One that
    changed is read on to its end and not memoized. Never more than ``MAX_HEADER_BYTES`` and a
    chunk read (``_TOO_BIG`` past it). ``parse=False`` (a directory walk's files) keeps no
    includes: a later include of the same file parses it then.
    """
    if sig is None or sig[0] != "f":
        return None
    if sig[2] > MAX_HEADER_BYTES:
        return _TOO_BIG
    cached = known_file(path, sig, parse=parse)
    if cached is not None:
        return cached
    try:
        fd = os.open(path, os.O_RDONLY)  # not open(): a file object costs more than reading a small header
    except OSError:
        return None
    try:
        chunks = [os.read(fd, sig[2] + 1)]
        after = signature_of_stat(os.fstat(fd))
        size = len(chunks[0])
        if after != sig or size != sig[2]:  # changed since the stat: read on to its end, as it is now
            while size <= MAX_HEADER_BYTES:
                chunk = os.read(fd, _HASH_CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    if size > MAX_HEADER_BYTES:
        return _TOO_BIG  # grew past the bound while we read it
    data = b"".join(chunks)
    info = FileInfo(hashlib.sha256(data, usedforsecurity=False).digest(), parse_includes(data) if parse else ())
    remember_file(path, sig, info, parse=parse, after=after)
    return info


def role_token(role: str) -> str:
    """How a role stands in a key where a path stood: ``<tiered-progcache:I0>``."""
    return f"<tiered-progcache:{role}>"


def path_roles(options: Any) -> tuple[tuple[str, str], ...]:
    """The roots a path may be named relative to, in order: ``(role, absolute directory)`` pairs.

    The include path by position (``I0``, ``I1``, ...), then the source's directory
    (``source``) unless ``no_source_include``; as spelled (made absolute), not resolved.
    Reads the working directory when ``options.name`` has no directory.
    """
    roles = [(f"I{i}", os.path.abspath(d)) for i, d in enumerate(path_list(getattr(options, "include_path", None)))]
    source_dir = _source_dir(options)
    if source_dir is not None:
        roles.append(("source", source_dir))
    return tuple(roles)


def role_relative(path: str, roles: Sequence[tuple[str, str]]) -> str | None:
    """An absolute ``path`` named by the first root it lies under: ``<tiered-progcache:I0>/cuda/x.h``.

    None if it lies under no root. Textual (the rest of the path is kept as spelled): the
    name only has to tell compiles apart; what the file holds is digested separately.
    """
    for role, root in roles:
        if path == root:
            return role_token(role)
        prefix = root if root.endswith(os.sep) else root + os.sep
        if path.startswith(prefix):
            return role_token(role) + "/" + path[len(prefix):].replace(os.sep, "/")
    return None


def locate(directory: str, real_include_dirs: Sequence[str], real_source_dir: str | None,
           cwd_real: str) -> tuple[str, str]:
    """``(role, path relative to it)`` of a real directory; ``("abs", directory)`` under no root.

    An include directory first (an exact match before a parent, as ``_Scan.dir_tag``),
    then the source's directory, then the working directory.
    """
    for i, d in enumerate(real_include_dirs):
        if directory == d:
            return f"I{i}", ""
    # Real paths are normalized: the rest after the root and a separator is ``os.path.relpath``'s answer.
    for i, d in enumerate(real_include_dirs):
        prefix = d.rstrip(os.sep) + os.sep
        if directory.startswith(prefix):
            return f"I{i}", directory[len(prefix):].replace(os.sep, "/")
    for role, root in (("source", real_source_dir), ("cwd", cwd_real)):
        if root is None:
            continue
        if directory == root:
            return role, ""
        prefix = root.rstrip(os.sep) + os.sep
        if directory.startswith(prefix):
            return role, directory[len(prefix):].replace(os.sep, "/")
    return "abs", directory


def file_digest(path: str, sig: Signature) -> bytes | None:
    """The sha256 of the regular file ``path`` whose signature is ``sig`` (memoized by it), without
    parsing it; None if it is not a readable file within ``MAX_HEADER_BYTES``."""
    info = _file_info(path, sig, parse=False)
    return None if info is None or info is _TOO_BIG else info.digest


class _Scan:
    """One walk of the include graph, collecting the digest stream, the paths probed and the files read.

    Paths are resolved as the OS resolves them (a symlinked directory followed before
    ``..``): an includer's directory is its ``realpath``, recorded so a retargeted
    symlink invalidates the memo, and the textual ``normpath`` reading is digested too.
    ``portable`` names directories and absolute spellings by role (see the module
    docstring); otherwise the stream is the location-bound one (:func:`header_digest`'s).
    """

    def __init__(self, roles: Sequence[tuple[str, str]], source_dir: str | None, *, portable: bool,
                 max_files: int | None = None) -> None:
        self.max_files = max_files  # past this many files read the walk stops (``_PastBound``)
        self.include_dirs = tuple(d for role, d in roles if role != "source")
        self.roles = tuple(roles)
        self.portable = portable
        self.hasher = hashlib.sha256(_PORTABLE_DIGEST_VERSION if portable else _DIGEST_VERSION, usedforsecurity=False)
        self.checks: dict[str, Signature] = {}
        self.real_checks: dict[str, str] = {}
        self.visited: set[tuple[str, tuple[tuple[int, str], ...]]] = set()
        self.queue: list[tuple[str, tuple[tuple[int, str], ...]]] = []
        self.fallback_dirs: dict[str, str] = {}
        self.read_anything = False
        self.racy = False  # something changed too recently to trust a stat next time
        self.files: dict[tuple[str, str], str] = {}  # (root, relative path) -> sha256 hex
        self.missing: set[str] = set()
        self.path_free = True  # nothing named by an absolute path so far
        self.declined: str | None = None  # why this compile cannot be keyed (then it is not cached)
        self.relocatable = True  # every probe built from a root or a recorded real directory (ScanResult)
        self.textual: dict[str, str] = {}  # normpath of a ``..`` candidate -> the candidate (ScanResult.textual)
        self.macros = MacroTable()  # every definition seen: what computed includes expand to
        self.calls: set[tuple[str, str, str | None, str]] = set()  # (fn, identifier arg, includer dir, tag)
        #: computed includes by (macro, includer dir, tag): the header names already resolved for each
        self.pending: dict[tuple[str, str | None, str], set[tuple[int, str]]] = {}
        self.cwd_real = os.path.realpath(os.getcwd())
        self.real_include_dirs = tuple(self.realpath(d) for d in self.include_dirs)
        self.real_source_dir = self.realpath(source_dir) if source_dir is not None else None

    def emit(self, label: str, payload: bytes) -> None:
        self.hasher.update(label.encode("ascii", "backslashreplace"))
        self.hasher.update(len(payload).to_bytes(8, "big"))
        self.hasher.update(payload)

    def probe(self, path: str) -> Signature:
        if path in self.checks:
            return self.checks[path]
        sig = self.checks[path] = signature(path)
        if is_racy(sig):
            self.racy = True
        return sig

    def realpath(self, directory: str) -> str:
        """Where the OS takes ``directory``; remembered, so a warm call sees a retargeted symlink."""
        real = self.real_checks.get(directory)
        if real is None:
            real = self.real_checks[directory] = os.path.realpath(directory)
        return real

    def locate(self, directory: str) -> tuple[str, str]:
        """``(role, path relative to it)`` of a real directory (:func:`locate`)."""
        return locate(directory, self.real_include_dirs, self.real_source_dir, self.cwd_real)

    def dir_tag(self, directory: str) -> str:
        """How a (real) directory is named in the digest: by role and relative path where it can be."""
        if self.portable:
            role, rel = self.locate(directory)
            if role == "abs":
                self.path_free = False
                return directory
            return f"{role}:{rel}" if rel else role
        # location-bound: by include-path index or relative to one, else absolute
        for i, d in enumerate(self.real_include_dirs):
            if directory == d:
                return f"I{i}"
        for i, d in enumerate(self.real_include_dirs):
            if directory.startswith(d.rstrip(os.sep) + os.sep):
                return f"I{i}:{os.path.relpath(directory, d)}"
        return directory

    def record(self, real_dir: str, name: str, digest: bytes) -> None:
        """Remember a file read, by the role of the (real) directory it lies in."""
        role, rel = self.locate(real_dir)
        if role == "abs":
            self.path_free = False
            path = os.path.join(real_dir, name)
        else:
            path = f"{rel}/{name}" if rel else name
        self.files[(role, path)] = digest.hex()

    def add_file(self, label: str, path: str, *, follow: bool = True) -> FileInfo | None:
        """Hash ``path`` if it is a readable file, and queue its includes (``follow``); None if absent."""
        sig = self.probe(path)
        info = _file_info(path, sig)
        if info is _TOO_BIG:
            self.decline(f"{label}: a header over {MAX_HEADER_BYTES} bytes")
            return info
        if info is None:
            return None
        self.read_anything = True
        self.emit(label, info.digest)
        if not follow:
            return info
        # What its includes resolve to depends only on its directory (as the OS finds it)
        # and on the includes themselves: one visit per pair, which also ends cycles.
        real_dir = self.realpath(os.path.dirname(path) or ".")
        self.record(real_dir, os.path.basename(path), info.digest)
        if self.max_files is not None and len(self.files) > self.max_files:
            raise _PastBound
        state = (real_dir, info.includes)
        if state not in self.visited:
            self.visited.add(state)
            self.queue.append(state)
        return info

    def spelled(self, spelling: str) -> str:
        """How an include's spelling enters the digest: an absolute one by role where it can be."""
        if not self.portable or not os.path.isabs(spelling):
            return spelling
        named = role_relative(spelling, self.roles)
        if named is None:
            self.path_free = False
            return spelling
        return named

    def resolve(self, kind: int, spelling: str, includer_dir: str | None, includer_tag: str) -> None:
        """Digest every file ``#include`` of ``spelling`` can open, in NVRTC's search order (docs/reliability.md):
        an absolute spelling as it stands; a quoted one in the including file's directory, then the
        include path; an angle one on the include path only. ``PRE_INCLUDE``: the working directory, then
        the include path."""
        shown = self.spelled(spelling)
        self.emit("include", f"{kind}:{shown}".encode("utf-8", "surrogateescape"))
        if os.path.isabs(spelling):
            if kind != PRE_INCLUDE or role_relative(spelling, self.roles) is None:
                self.relocatable = False  # a path spelled in a file, or one under no root the options name
            candidates = [("abs", "")]
        else:
            candidates = []
            if kind == PRE_INCLUDE:
                candidates.append(("cwd", os.getcwd()))
            elif kind == QUOTE and includer_dir is not None:
                candidates.append((includer_tag, includer_dir))
            candidates.extend((f"I{i}", d) for i, d in enumerate(self.include_dirs))
        found = False
        for tag, directory in candidates:
            path = os.path.join(directory, spelling) if directory else spelling
            if self.add_file(f"found:{tag}", path):  # as the OS opens it
                found = True
            textual = os.path.normpath(path)
            if textual != path:
                self.textual.setdefault(textual, path)
            if textual != path and self.realpath(os.path.dirname(textual)) != self.realpath(os.path.dirname(path)):
                # ``..`` read as text lands elsewhere: digest that file too (more, never less)
                self.relocatable = False
                if self.add_file(f"found-text:{tag}", textual):
                    found = True
        if not found:
            # A built-in NVRTC header or one the compile will fail on: keyed by name only.
            self.emit("missing", b"")
            self.missing.add(shown)

    def computed(self, includer_dir: str | None, includer_tag: str) -> None:
        """``#include MACRO`` or anything unreadable: every file it could reach through the directories counts."""
        self.emit("computed", b"")
        if includer_dir is not None:
            self.fallback_dirs.setdefault(includer_dir, includer_tag)
        for i, d in enumerate(self.include_dirs):
            self.fallback_dirs.setdefault(d, f"I{i}")

    def include(self, kind: int, spelling: str, includer_dir: str | None, includer_tag: str) -> None:
        """One entry of a file's parse: an include resolved now, a macro fact, or a computed include for later."""
        if kind in (QUOTE, ANGLE):
            self.resolve(kind, spelling, includer_dir, includer_tag)
        elif kind == COMPUTED:
            if spelling:
                self.pending.setdefault((spelling, includer_dir, includer_tag), set())
            else:
                self.computed(includer_dir, includer_tag)
        elif kind == DEFINE:
            name, _, value = spelling.partition("\n")
            self.macros.define(name, value)
        elif kind == HAS_WRAPPER:
            self.macros.wrappers.add(spelling)
        elif kind == WRAPS:
            macro, _, callee = spelling.partition("\n")
            self.macros.wraps.add((macro, callee))
        elif kind == CALL:
            fn, _, arg = spelling.partition("\n")
            self.calls.add((fn, arg, includer_dir, includer_tag))

    def drain(self) -> None:
        """Follow every include, then resolve computed ones through the definitions seen, until nothing new."""
        while True:
            while self.queue:
                own_dir, includes = self.queue.pop(0)
                tag = f"cur:{self.dir_tag(own_dir)}"
                for kind, spelling in includes:
                    self.include(kind, spelling, own_dir, tag)
            self.macros.close_wrappers()
            for fn, arg, own_dir, tag in sorted(self.calls, key=repr):
                if fn in self.macros.wrappers:  # ``W(MACRO)`` where ``W(x)`` is ``__has_include(x)``
                    self.pending.setdefault((arg, own_dir, tag), set())
            for (name, own_dir, tag), done in sorted(self.pending.items(), key=lambda item: repr(item[0])):
                expansions = self.macros.expand(name)
                if expansions is None:
                    continue  # not (yet) resolvable: if it stays so, the directories count (finish)
                for kind, spelling in sorted(expansions - done):
                    done.add((kind, spelling))
                    self.emit("computed-as", f"{name}:{kind}:{spelling}".encode("utf-8", "surrogateescape"))
                    self.resolve(kind, spelling, own_dir, tag)
            if not self.queue:
                break
        for (name, own_dir, tag), done in sorted(self.pending.items(), key=lambda item: repr(item[0])):
            if self.macros.expand(name) is None:
                self.computed(own_dir, tag)

    def hash_fallback_dirs(self) -> None:
        """Hash every file under the directories an unresolvable computed include could reach, within bounds.

        Never the working directory, ``/`` or any directory above them (finding: a checkpoint beside
        the script), never past ``MAX_WALK_FILES`` files or ``MAX_WALK_BYTES`` bytes: then the
        compile is declined instead (not cached), since what it reads cannot be known.
        """
        cwd = os.path.realpath(os.getcwd())
        files = total = 0
        for directory, tag in sorted(self.fallback_dirs.items(), key=lambda item: item[1]):
            real_dir = self.realpath(directory)
            if real_dir == "/" or cwd == real_dir or cwd.startswith(real_dir.rstrip(os.sep) + os.sep):
                self.decline(f"a computed #include the scanner cannot resolve could read any file under "
                             f"{'/' if real_dir == '/' else 'the working directory'} ({tag}), which is never walked")
                return
        for directory, tag in sorted(self.fallback_dirs.items(), key=lambda item: item[1]):
            self.emit("tree", tag.encode("utf-8", "surrogateescape"))
            real_dir = self.realpath(directory)
            for path in _walk_files(directory, self):
                sig = self.checks[path]
                files += 1
                total += sig[2] if sig is not None and sig[0] == "f" else 0
                if files > MAX_WALK_FILES or total > MAX_WALK_BYTES:
                    self.decline(f"a computed #include the scanner cannot resolve could read any of more than "
                                 f"{MAX_WALK_FILES} files or {MAX_WALK_BYTES} bytes under {tag}")
                    return
                info = _file_info(path, sig, parse=False)
                if info is _TOO_BIG:
                    self.decline(f"{tag}:{os.path.relpath(path, directory)} is over {MAX_HEADER_BYTES} bytes")
                    return
                if info is not None:
                    self.read_anything = True
                    rel = os.path.relpath(path, directory)
                    self.emit("tree-file", rel.encode("utf-8", "surrogateescape") + b"\0" + info.digest)
                    self.record(real_dir, rel.replace(os.sep, "/"), info.digest)

    def decline(self, reason: str) -> None:
        """What this compile reads cannot be known within bounds: it is not cached (first reason kept)."""
        if self.declined is None:
            self.declined = reason
        self.emit("declined", reason.encode("utf-8", "surrogateescape"))

    def outcome(self) -> tuple[tuple[HeaderFile, ...], tuple[str, ...]]:
        """The files read, sorted, and the sorted missing spellings."""
        return (tuple(sorted(HeaderFile(root, path, digest) for (root, path), digest in self.files.items())),
                tuple(sorted(self.missing)))


def _walk_files(directory: str, scan: _Scan) -> Iterable[str]:
    """Files under ``directory`` in a stable order, through symlinked directories (each real one once).

    Each directory's signature is recorded, so a file appearing later changes the digest.
    """
    seen: set[str] = set()
    stack = [directory]
    while stack:
        current = stack.pop()
        scan.probe(current)
        real = os.path.realpath(current)
        if real in seen:
            continue
        seen.add(real)
        try:
            names = sorted(os.listdir(current))
        except OSError:
            continue
        subdirs = []
        for name in names:
            path = os.path.join(current, name)
            sig = scan.probe(path)
            if sig is not None and sig[0] == "d":
                subdirs.append(path)
            else:
                yield path
        stack.extend(reversed(subdirs))


def _command_line_defines(value: object) -> tuple[tuple[str, str], ...]:
    """``define_macro`` as ``(name, value)`` pairs (``-DNAME`` is ``1``), as NVRTC's ``-D`` reads them."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, tuple)) else list(value) if isinstance(value, Sequence) else []
    pairs = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2:
            pairs.append((str(item[0]), str(item[1])))
        elif isinstance(item, str):
            name, eq, val = item.partition("=")
            pairs.append((name, val if eq else "1"))
    return tuple(pairs)


def path_list(value: object) -> list[str]:
    """An option that holds one path or several (``include_path``, ``pre_include``) as a list of str."""
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
    if path_list(getattr(options, "include_path", None)) or path_list(getattr(options, "pre_include", None)):
        return True
    if getattr(options, "pch", None) or any(
        getattr(options, name, None) is not None for name in ("use_pch", "pch_dir")
    ):
        return True
    name = getattr(options, "name", None)
    return isinstance(name, str) and ("/" in name or "\\" in name)


def _libdevice_scan(portable: bool) -> HeaderScan:
    # cuda.pathfinder's public finder: the same file cuda-core's NVVM path links in.
    from cuda.pathfinder import find_bitcode_lib

    path = os.fspath(find_bitcode_lib("device"))
    info = _file_info(path, signature(path))
    if info is None:
        raise FileNotFoundError(f"libdevice not readable at {path}")
    # The file's content only, never its place: the same digest in both streams.
    digest = hashlib.sha256(_DIGEST_VERSION + b"\0libdevice\0" + info.digest, usedforsecurity=False).digest()
    return HeaderScan(digest, (HeaderFile("libdevice", os.path.basename(path), info.digest.hex()),), (), portable)


def header_digest(
    source: str | bytes,
    options: Any,
    code_type: str = "c++",
    *,
    recheck_s: float = 0.0,
    memo_dir: str | os.PathLike[str] | None = None,
) -> bytes | None:
    """The ``extra_digest`` covering every file the compile of ``source`` could read, or None.

    None means the compile reads no file beyond the source (no include path, no
    pre-include, no quoted include found next to the source), so the key is the one
    ``Program.compile(cache=...)`` would use and entries are shared with it.

    >>> opts = ProgramOptions(arch="sm_90", include_path=[cccl_dir])
    >>> key = make_program_cache_key(code=src, code_type="c++", options=opts,
    ...                              target_type="cubin", extra_digest=header_digest(src, opts))

    This is the location-bound digest (a directory outside the include path is named by
    its absolute path), the one ``compile(portable_keys=False)`` uses; :func:`header_scan`
    gives the portable one and the files read.

    ``recheck_s``: trust a scan this process already validated for that many seconds
    without looking again (0, the default: every call looks, so an edited header is
    seen at once; with inotify that costs one ``poll(2)``, without it a stat per header).

    ``memo_dir``: a directory where scans persist for the next process (``compile()``
    passes ``<local cache dir>/header-scans``); None keeps the memo in this process only.

    Thread-safe and process-safe: it only reads headers (and writes ``memo_dir``
    atomically); a racing writer at worst causes a rehash. The working directory and include
    directories are read at call time (relative include paths follow ``os.getcwd()``).
    """
    code_type = code_type.lower()
    if code_type == "nvvm":
        return _libdevice_scan(False).digest if getattr(options, "use_libdevice", None) else None
    result = _scan(source, options, code_type, recheck_s, portable=False, memo_dir=memo_dir)
    if result is None:
        return None
    return result.digest if result.read_anything or needs_header_digest(options, code_type) else None


def header_scan(
    source: str | bytes,
    options: Any,
    code_type: str = "c++",
    *,
    recheck_s: float = 0.0,
    portable: bool = True,
    memo_dir: str | os.PathLike[str] | None = None,
    memo_only: bool = False,
    max_files: int | None = None,
    memoize_scan: bool = True,
) -> HeaderScan | None:
    """The digest covering every file the compile of ``source`` could read, and those files.

    >>> scan = header_scan(src, ProgramOptions(arch="sm_90", include_path=[cccl_dir]))
    >>> scan.headers[0]
    HeaderFile(root='I0', path='cuda/std/__cccl/assert.h', digest='9f0c...')

    ``portable`` (default): the digest names directories by role (``I0``, ``source``)
    and the path relative to it, so the same headers under another root digest the
    same; ``HeaderScan.path_free`` says whether that held everywhere. ``portable=False``:
    the digest :func:`header_digest` returns. The files read are recorded either way and
    memoized with the scan: a warm call re-stats and returns them without reading any.
    ``recheck_s``, ``memo_dir`` and thread-safety as :func:`header_digest`. ``memo_only``: None
    instead of scanning where no memo answers (:mod:`.direct` asks its manifest first); ``max_files``:
    None where the scan reads more files than that (what it read stays memoized file by file);
    ``memoize_scan`` False: a scan run now is not memoized (the caller adopts it later: :func:`adopt_scan`).
    """
    code_type = code_type.lower()
    if code_type == "nvvm":
        return _libdevice_scan(portable) if getattr(options, "use_libdevice", None) else _NOTHING_READ[portable]
    result = _scan(source, options, code_type, recheck_s, portable=portable, memo_dir=memo_dir, memo_only=memo_only,
                   max_files=max_files, memoize_scan=memoize_scan)
    if result is _NOT_MEMOIZED:
        return None
    if result is None:
        return _NOTHING_READ[portable]
    return scan_view(result, options, code_type, portable)


def scan_view(result: ScanResult, options: Any, code_type: str, portable: bool) -> HeaderScan:
    """The :class:`HeaderScan` a scan result stands for."""
    if not result.read_anything:  # then whether a digest is due depends on the options too
        digest = result.digest if needs_header_digest(options, code_type) or result.declined else None
        return HeaderScan(digest, (), result.missing, result.path_free and portable, result.declined)
    return HeaderScan(result.digest, result.headers, result.missing, result.path_free and portable, result.declined,
                      result)


def _scan(
    source: str | bytes,
    options: Any,
    code_type: str,
    recheck_s: float,
    *,
    portable: bool,
    memo_dir: str | os.PathLike[str] | None,
    memo_only: bool = False,
    max_files: int | None = None,
    memoize_scan: bool = True,
) -> ScanResult | None:
    """The (memoized) scan of what the compile of ``source`` could read; None when it reads nothing for sure.

    ``memo_only``: ``_NOT_MEMOIZED`` where a scan would have to run; so too past ``max_files`` files read.
    """
    if code_type != "c++":
        return None  # PTX: the linker reads no headers; cuda-core drops include options there

    if isinstance(source, str) and names_no_file(source) and not needs_header_digest(options, code_type):
        return None  # no directive can read a file, however spelled (the common case, kept cheap)
    if not isinstance(source, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"source must be str or bytes, got {type(source).__name__}")

    memo_key = _memo_key(source, options, portable)
    cached = memoized(memo_key, recheck_s, memo_dir, _scanner_id)
    if cached is not None:
        return cached
    if memo_only:
        return _NOT_MEMOIZED
    global _scans_run
    _scans_run += 1
    try:
        return _scan_now(source, options, memo_key, portable=portable, memo_dir=memo_dir, max_files=max_files,
                         memoize_scan=memoize_scan)
    except _PastBound:
        return _NOT_MEMOIZED


def _memo_key(source: str | bytes, options: Any, portable: bool) -> tuple[Any, ...]:
    """What the memo of a scan is found by: what the caller passed, unresolved (cheap to hash: a
    str caches its hash); the working directory joins it because relative paths follow it."""
    return (
        source if isinstance(source, (str, bytes)) else bytes(source),
        _hashable(getattr(options, "include_path", None)),
        _hashable(getattr(options, "pre_include", None)),
        getattr(options, "name", None),
        bool(getattr(options, "no_source_include", False)),
        _hashable(getattr(options, "use_pch", None)),
        _command_line_defines(getattr(options, "define_macro", None)),  # computed includes resolve through them
        os.getcwd(),
        portable,
    )


def _scan_now(
    source: str | bytes, options: Any, memo_key: tuple[Any, ...], *, portable: bool,
    memo_dir: str | os.PathLike[str] | None, max_files: int | None = None, memoize_scan: bool = True,
) -> ScanResult:
    """Walk the include graph now, and memoize what it found."""
    data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else bytes(source)
    roles = path_roles(options)
    pre_includes = tuple(path_list(getattr(options, "pre_include", None)))
    source_dir = _source_dir(options)
    use_pch = getattr(options, "use_pch", None)
    use_pch_path = os.path.abspath(os.fspath(use_pch)) if isinstance(use_pch, (str, os.PathLike)) else None

    scan = _Scan(roles, source_dir, portable=portable, max_files=max_files)
    source_real = scan.real_source_dir
    for name, value in _command_line_defines(getattr(options, "define_macro", None)):
        scan.macros.define(name, value)
    for spelling in pre_includes:
        scan.resolve(PRE_INCLUDE, spelling, None, "pre_include")
    for kind, spelling in parse_includes(data):
        scan.include(kind, spelling, source_real, "source")
    scan.drain()
    scan.hash_fallback_dirs()
    if use_pch_path is not None:
        pch = scan.add_file("use_pch", use_pch_path, follow=False)
        if pch is None:
            scan.emit("use_pch-missing", b"")
        else:
            scan.files[("use_pch", os.path.basename(use_pch_path))] = pch.digest.hex()
    digest = scan.hasher.digest()
    read_anything = scan.read_anything or bool(scan.fallback_dirs)
    files, missing = scan.outcome()
    result = ScanResult(
        digest, read_anything, tuple(scan.checks.items()), tuple(scan.real_checks.items()), time.monotonic(),
        files, missing, scan.path_free, scan.declined, scan.relocatable and use_pch_path is None,
        tuple(sorted(scan.textual.items())),
    )

    if memoize_scan:
        memoize(memo_key, None if scan.racy else result, memo_dir, _scanner_id)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("header scan: %d files read, %d paths probed, %d directory fallbacks",
                     len(scan.visited), len(scan.checks), len(scan.fallback_dirs))
    return result


#: What ``_scan(memo_only=True)`` returns where a scan would have to run (or ran past ``max_files``).
_NOT_MEMOIZED: Any = object()


class _PastBound(Exception):
    """A scan read more files than its ``max_files``: it stops there, memoizing nothing."""
_scans_run = 0  # include-graph walks this process ran (memo misses), for tests and benchmarks


def scans_run() -> int:
    """Include-graph walks this process has run so far (each memo miss counts one; read without a lock)."""
    return _scans_run


def adopt_scan(source: str | bytes, options: Any, portable: bool, result: ScanResult,
               memo_dir: str | os.PathLike[str] | None = None) -> None:
    """Memoize a scan result made elsewhere (:mod:`.direct`'s verified set) as a scan would: here now,
    and in ``memo_dir`` at exit (so the next process on the node validates it by stat, hashing nothing)."""
    headermemo.persist_at_exit(_memo_key(source, options, portable), result, memo_dir)


_scanner_id_value: bytes | None = None


def _scanner_id() -> bytes | None:
    """The scanner's own code, hashed: a memo persisted by another version of it is never read.

    The code is the lexer's, this module's and the memo's (what a scan finds, and what it records).
    None (nothing persisted, logged once) where a module's file cannot be read (a zip import).
    """
    global _scanner_id_value
    if _scanner_id_value is None:
        hasher = hashlib.sha256(usedforsecurity=False)
        try:
            for module_file in (headerlex.__file__, __file__, headermemo.__file__):
                with open(module_file, "rb") as fh:
                    code = fh.read()
                hasher.update(len(code).to_bytes(8, "big") + code)
            _scanner_id_value = hasher.digest()
        except OSError as exc:
            log_once(logger, "no-scanner-id", logging.INFO, "header scans are not persisted: %s", exc)
            _scanner_id_value = b""
    return _scanner_id_value or None


headermemo.register_scanner(_scanner_id)
