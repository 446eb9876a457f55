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

Directives are found the way the compiler finds them, on preprocessor tokens after
translation phases 1-3: line splices removed, each comment one space, ``%:`` is
``#``, string and raw-string literals skipped. Where a reading is in doubt (trigraphs,
a backslash followed by spaces, a lone CR) every reading counts; where the scanner
cannot tell at all (an unterminated comment or raw string) it falls back to the whole
directories as above. Paths resolve as the OS resolves them: ``..`` after a symlinked
directory goes to the symlink target's parent (and the textual reading is digested too).

Search rules (checked against NVRTC 13, docs/reliability.md "Where NVRTC looks for a
header"): ``"x"`` is looked up in the including file's directory, then the include
path (no includer stack); ``<x>`` only on the include path; the main source's directory
is ``dirname(options.name)``, or the working directory when the name has none (unless
``no_source_include``); a relative ``pre_include`` in the working directory, then the
include path (role ``cwd`` where the working directory is not the source's).

Two streams (``portable``): the location-bound digest (:func:`header_digest`, and
``compile(portable_keys=False)``) names a directory outside the include path by its
absolute path, as it always has. The portable digest (:func:`header_scan`, the default
of ``compile()``) names every directory and absolute spelling by its role, the
include-path position (``I0``, ``I1``, ...) or the source's directory (``source``),
plus the path relative to it, so the same files under another root give the same
digest. What lies under no root keeps its absolute path and the scan says so
(``HeaderScan.path_free`` False). Either scan records the files it read as
:class:`HeaderFile` s, named by role and relative path.

Cost: file digests are memoized by ``(path, inode, size, mtime_ns, ctime_ns)``, and
a whole scan is memoized with the list of paths it probed. A warm call asks
:mod:`.headerwatch` whether inotify saw anything the scan depends on change (one
``poll(2)``, no stat); where inotify is unavailable or not trusted (a network
filesystem) it re-stats those paths instead (about a microsecond each). Either way it
hashes nothing. Before inotify vouches for a scan it is validated by stat once: at its
second use in the process, after an event on something it depends on, and when it is
loaded from disk (then by stat alone). A file modified in the last ``RACY_NS`` is hashed
on every call: two edits within one coarse clock tick can leave its stat unchanged.

Across processes: with ``memo_dir`` (``compile()`` passes the local cache directory's
``header-scans/``) a scan is persisted by :mod:`.scanmemo`, and a new process loads and
validates it instead of scanning again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Union

from . import forks, headerwatch, scanmemo
from .headerwatch import Subscription
from .ratelimit import log_once

__all__ = [
    "HeaderFile",
    "HeaderScan",
    "ValidationCounts",
    "clear_memo",
    "files_hashed",
    "header_digest",
    "header_scan",
    "needs_header_digest",
    "path_roles",
    "role_relative",
    "role_token",
    "validation_counts",
]

logger = logging.getLogger(__name__)

_DIGEST_VERSION = b"tiered-progcache/headers/1"
#: The portable stream starts elsewhere: it never equals a location-bound digest.
_PORTABLE_DIGEST_VERSION = b"tiered-progcache/headers/portable/1"

_QUOTE, _ANGLE, _COMPUTED = 0, 1, 2
#: What the parser records besides includes, so the scan can resolve macros as the preprocessor does:
#: an object-like ``#define`` ("NAME\nvalue"), a function-like macro wrapping ``__has_include`` of its
#: parameter ("NAME"), one calling another with its parameter ("NAME\nCALLEE"), and a call
#: ``IDENT(ARG)`` on an ``#if``/``#elif``/``#define`` line ("IDENT\nARG"), a ``__has_include``
#: through a wrapper when IDENT turns out to be one. A ``_COMPUTED`` entry's spelling is the macro
#: it names ("" when it is no single identifier).
_DEFINE, _HAS_WRAPPER, _WRAPS, _CALL = 3, 4, 5, 6
#: A ``pre_include`` (``--pre-include``): looked up in the working directory, then on the include path.
_PRE_INCLUDE = 7
_IDENT_RE = re.compile(r"[A-Za-z_$][\w$]*")
_IDENT_SPLIT_RE = re.compile(r"([A-Za-z_$][\w$]*)")
#: Bounds on resolving a computed include through definitions (past them it is unresolvable).
_MAX_EXPANSION_DEPTH = 16
_MAX_EXPANSIONS = 64

#: Files whose digest this process remembers; past this the memo is dropped and rebuilt.
MAX_MEMO_FILES = 200_000
#: Whole scans remembered (one per distinct source and search configuration).
MAX_MEMO_SCANS = 4096
#: Largest header hashed (streamed, never read whole past this): a bigger one declines the compile.
MAX_HEADER_BYTES = 32 << 20
#: Most files, and bytes, an unresolvable computed include's directory walk reads before the compile
#: is declined (never cached) instead: the whole CCCL tree is about 2,000 files and 25 MB.
MAX_WALK_FILES = 20_000
MAX_WALK_BYTES = 256 << 20
_HASH_CHUNK = 1 << 20

Signature = Union[tuple[Any, ...], None]

#: A file changed this recently (ns) may change again within one coarse clock tick
#: without its signature changing ("racy git"): it is hashed again on every call.
RACY_NS = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class _FileInfo:
    digest: bytes
    includes: tuple[tuple[int, str], ...]


#: What _file_info returns for a file over MAX_HEADER_BYTES (the scan then declines the compile).
_TOO_BIG = _FileInfo(b"", ())


@dataclasses.dataclass(frozen=True)
class HeaderFile:
    """One file a compile can read, named by where the compiler finds it, not where it lives. Immutable.

    ``root`` is the role of the root it lies under: ``"I0"``, ``"I1"``, ... (the include
    path, by position), ``"source"`` (the source's directory), ``"cwd"`` (the working directory,
    where a relative ``pre_include`` is found, when it is not the source's), ``"use_pch"`` (the PCH file
    ``use_pch`` names; ``path`` is its basename), ``"libdevice"`` (NVVM), or ``"abs"``
    (under no root: ``path`` is then absolute, and the key is not portable).
    ``path`` is relative to the root, '/'-separated; ``digest`` the sha256 hex of its bytes.
    """

    root: str
    path: str
    digest: str


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


_NOTHING_READ = {True: HeaderScan(None, (), (), True), False: HeaderScan(None, (), (), False)}  # by ``portable``


@dataclasses.dataclass
class _ScanResult:
    """One scan: persisted field by field (scanmemo), except the fields marked per-process."""

    digest: bytes
    read_anything: bool
    checks: tuple[tuple[str, Signature], ...]
    real_checks: tuple[tuple[str, str], ...]  # directory -> where the OS took it
    checked_at: float = dataclasses.field(metadata=scanmemo.PER_PROCESS)  # time.monotonic() of the last full re-stat
    headers: tuple[tuple[str, str, str], ...]  # (root, path, sha256 hex) of every file covered, sorted
    missing: tuple[str, ...]  # include spellings found nowhere, sorted
    path_free: bool  # the digest and every file's name are free of absolute paths
    declined: Union[str, None]  # why the compile cannot be keyed (HeaderScan.declined), or None
    #: inotify's word that nothing in ``checks`` changed since that re-stat (None: re-stat on the next call)
    watch: Subscription | None = dataclasses.field(default=None, compare=False, repr=False, kw_only=True,
                                                   metadata=scanmemo.PER_PROCESS)
    #: validations by stat in this process (the scan itself counts one): watched from the second on
    validations: int = dataclasses.field(default=1, compare=False, kw_only=True, metadata=scanmemo.PER_PROCESS)


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


_file_memo: dict[str, tuple[Signature, _FileInfo, bool]] = {}  # path -> (signature, info, parsed)
_scan_memo: dict[tuple[Any, ...], _ScanResult] = {}
_memo_lock = threading.Lock()
_files_hashed = 0  # files read and hashed by this process (memo misses), for tests and benchmarks
_by_stat = _by_watch = _paths_statted = 0  # see ValidationCounts
_memo_stores: dict[str, scanmemo.ScanMemoStore] = {}
_scanner_id_value: bytes | None = None


def _signature(path: str) -> Signature:
    """What a later stat must match for a memoized answer about ``path`` to stand."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return ("error", type(exc).__name__)
    return _signature_of_stat(st)


def _signature_of_stat(st: os.stat_result) -> Signature:
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
        elif _signature(path) != sig:
            return False
    return True


# -- directives, found on preprocessor tokens ------------------------------------------------------
#
# The compiler finds directives after translation phases 1-3: line splices removed,
# comments replaced by one space, ``%:`` spelling ``#``. So does the scanner, on bytes,
# with regular expressions that skip the text between the few tokens that matter
# (newlines, comments, literals, ``#``). A spelling it cannot judge (a computed include,
# an unterminated comment or raw string) adds a ``_COMPUTED`` entry: digest more.

_ID_CHAR = rb"[\w$\x80-\xff]"
_NOT_AFTER_ID = rb"(?<![\w$\x80-\xff])"
_WS_OR_COMMENT = rb"(?:[ \t\f\v\r\0]|/\*.*?\*/)*"
_TOKEN_RE = re.compile(
    rb"(?=[/\"'#%0-9.uULR_i])"  # the first bytes of the tokens below: fails fast everywhere else
    rb"(?:(?P<bc>/\*)"
    rb"|(?P<lc>//[^\n]*)"
    rb'|(?P<raw>' + _NOT_AFTER_ID + rb'(?:u8|u|U|L)?R"(?P<delim>[^ ()\\\t\v\f\n"]{0,16})\()'
    rb'|(?P<str>"(?:[^"\\\n]|\\.)*"?)'
    rb"|(?P<chr>'(?:[^'\\\n]|\\.)*'?)"
    # only a number with a digit separator matters (its ``'`` opens no character literal)
    rb"|(?P<num>" + _NOT_AFTER_ID + rb"\.?[0-9](?:[eEpP][+-]|[\w$\x80-\xff.])*'" + _ID_CHAR
    + rb"(?:[eEpP][+-]|'" + _ID_CHAR + rb"|[\w$\x80-\xff.])*)"
    rb"|(?P<hash>\#|%:)"
    rb"|(?P<has>" + _NOT_AFTER_ID + rb"__has_(?:include(?:_next)?|embed)(?!" + _ID_CHAR + rb"))"
    rb"|(?P<imp>" + _NOT_AFTER_ID + rb"import(?!" + _ID_CHAR + rb")))"
)
_DIRECTIVE_NAME_RE = re.compile(
    _WS_OR_COMMENT + rb"(?P<name>include_next|include|import|embed|define|undef|elif|if)(?!" + _ID_CHAR + rb")"
    + _WS_OR_COMMENT,
    re.DOTALL,
)
_COMMENT_RE = re.compile(rb"/\*.*?\*/|//[^\n]*", re.DOTALL)
#: A single identifier and nothing else (a computed include naming one macro).
_LONE_NAME_RE = re.compile(rb"[ \t\f\v\r\0]*(?P<name>[A-Za-z_$\x80-\xff][\w$\x80-\xff]*)[ \t\f\v\r\0]*\Z")
#: ``NAME(a, b)`` right after ``#define``: a function-like macro's parameters.
_PARAMS_RE = re.compile(rb"\((?P<params>[^)\n]*)\)")
#: ``IDENT(<x>)``, ``IDENT("x")``, ``IDENT(ARG)`` on a directive line: a possible ``__has_include`` wrapper call.
_CALL_RE = re.compile(
    rb"(?<![\w$\x80-\xff])(?P<fn>[A-Za-z_][\w$]*)[ \t]*\([ \t]*"
    rb'(?:"(?P<q>[^"\n]*)"|<(?P<a>[^>\n]*)>|(?P<arg>[A-Za-z_][\w$]*))[ \t]*\)'
)
#: Longest ``#define`` value remembered for resolving computed includes.
_MAX_DEFINE_CHARS = 512
_MACRO_NAME_RE = re.compile(rb"[A-Za-z_$\x80-\xff][\w$\x80-\xff]*")
_HEADER_NAME_RE = re.compile(rb'"(?P<q>[^"\n]*)"|<(?P<a>[^>\n]*)>')
_HAS_ARG_RE = re.compile(_WS_OR_COMMENT + rb"\(" + _WS_OR_COMMENT, re.DOTALL)
_SKIP_RE = re.compile(_WS_OR_COMMENT, re.DOTALL)
_LINE_WS = b" \t\f\v\r\0"
_TRIGRAPHS = {b"=": b"#", b"/": b"\\", b"'": b"^", b"(": b"[", b")": b"]", b"!": b"|", b"<": b"{", b">": b"}", b"-": b"~"}
_TRIGRAPH_RE = re.compile(rb"\?\?([=/'()!<>-])")
_LENIENT_SPLICE_RE = re.compile(rb"\\[ \t\f\v]+(?=\r\n|\n|\r)")
_SPLICE_HINT_RE = re.compile(r"\\[ \t\f\v]*[\r\n]")


def _phases_1_2(data: bytes, *, trigraphs: bool, lenient_splice: bool, cr_newline: bool) -> bytes:
    """One reading of the bytes as the compiler may take them: newlines, trigraphs, splices."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if trigraphs:
        data = _TRIGRAPH_RE.sub(lambda m: _TRIGRAPHS[m.group(1)], data)
    if lenient_splice:
        data = _LENIENT_SPLICE_RE.sub(b"\\\\", data)
    data = data.replace(b"\r\n", b"\n")
    if cr_newline:
        data = data.replace(b"\r", b"\n")
    return data.replace(b"\\\n", b"")


def _scan_directives(text: bytes) -> list[tuple[int, str]]:
    """The includes one reading of ``text`` names, in order; ``_COMPUTED`` where it cannot tell."""
    found: list[tuple[int, str]] = []

    def line_end(at: int) -> int:
        end = text.find(b"\n", at)
        return len(text) if end < 0 else end

    def header(kind_pos: int) -> int:
        m = _HEADER_NAME_RE.match(text, kind_pos)
        if m is None:
            end = line_end(kind_pos)
            operand = _COMMENT_RE.sub(b" ", text[kind_pos:end])
            lone = _LONE_NAME_RE.match(operand)
            # ``#include MACRO``: resolved through the scan's definitions; anything else: the directories count
            found.append((_COMPUTED, lone.group("name").decode("utf-8", "surrogateescape") if lone else ""))
            return kind_pos
        quoted = m.group("q")
        if quoted is not None:
            found.append((_QUOTE, quoted.decode("utf-8", "surrogateescape")))
        else:
            found.append((_ANGLE, m.group("a").decode("utf-8", "surrogateescape")))
        return m.end()

    def calls(start_at: int, end: int, params: frozenset[str] | None, macro: str) -> None:
        """Record each ``IDENT(<x>)`` / ``IDENT("x")`` / ``IDENT(ARG)`` call between ``start_at`` and ``end``."""
        for call in _CALL_RE.finditer(text, start_at, end):
            fn = call.group("fn")
            if fn in (b"defined", b"__has_include", b"__has_include_next", b"__has_embed"):
                continue  # ``defined(X)`` reads nothing; ``__has_include`` is a token of its own
            fn_name = fn.decode("utf-8", "surrogateescape")
            if call.group("q") is not None:
                found.append((_QUOTE, call.group("q").decode("utf-8", "surrogateescape")))
            elif call.group("a") is not None:
                found.append((_ANGLE, call.group("a").decode("utf-8", "surrogateescape")))
            else:
                arg = call.group("arg").decode("utf-8", "surrogateescape")
                if params is not None and arg in params:
                    found.append((_WRAPS, f"{macro}\n{fn_name}"))
                else:
                    found.append((_CALL, f"{fn_name}\n{arg}"))

    def define(at: int) -> tuple[int, int, frozenset[str] | None]:
        """Record a ``#define``: an object-like one's value, a function-like one's calls. Returns
        (where to scan on, where the directive ends, its parameters or None)."""
        nonlocal define_name
        macro_m = _MACRO_NAME_RE.match(text, at)
        if macro_m is None:
            return at, -1, None
        end = line_end(macro_m.end())
        define_name = macro_m.group().decode("utf-8", "surrogateescape")
        params_m = _PARAMS_RE.match(text, macro_m.end())
        if params_m is not None:  # function-like: ``(`` right after the name
            params = frozenset(p.strip().decode("utf-8", "surrogateescape")
                               for p in params_m.group("params").split(b","))
            calls(params_m.end(), end, params, define_name)
            return macro_m.end(), end, params
        value = _COMMENT_RE.sub(b" ", text[macro_m.end():end]).strip(_LINE_WS)
        if len(value) <= _MAX_DEFINE_CHARS:
            found.append((_DEFINE, define_name + "\n" + value.decode("utf-8", "surrogateescape")))
        calls(macro_m.end(), end, None, define_name)
        return macro_m.end(), end, None

    define_name = ""
    define_end = -1  # where the ``#define`` being read ends (its body's tokens lie before it)
    define_params: frozenset[str] | None = None
    pos = 0
    clean = True  # nothing but whitespace and comments between the last line start and ``pos``
    search = _TOKEN_RE.search
    rfind = text.rfind

    def line_start_before(start: int) -> bool:
        """Only whitespace and comments between the start of the line and ``start``?"""
        newline = rfind(b"\n", pos, start)
        if newline >= 0:
            return not text[newline + 1 : start].strip(_LINE_WS)
        return clean and not text[pos:start].strip(_LINE_WS)

    while True:
        m = search(text, pos)
        if m is None:
            return found
        start = m.start()
        kind = m.lastgroup
        at_line_start = line_start_before(start) if kind in ("bc", "hash") else False
        pos = m.end()
        clean = False
        if kind == "bc":
            clean = at_line_start  # a comment is one space: the line is as clean after it as before
            end = text.find(b"*/", pos)
            if end < 0:
                found.append((_COMPUTED, ""))  # unterminated comment: cannot tell what it hides
                return found
            pos = end + 2
        elif kind == "raw":
            close = b")" + m.group("delim") + b'"'
            end = text.find(close, pos)
            if end < 0:
                found.append((_COMPUTED, ""))
                return found
            pos = end + len(close)
        elif kind == "hash":
            if at_line_start:
                d = _DIRECTIVE_NAME_RE.match(text, pos)
                if d is not None:
                    name = d.group("name")
                    if name == b"define":
                        pos, define_end, define_params = define(d.end())
                    elif name == b"undef":
                        macro = _MACRO_NAME_RE.match(text, d.end())
                        pos = macro.end() if macro is not None else d.end()
                    elif name in (b"if", b"elif"):
                        calls(d.end(), line_end(d.end()), None, b"")
                        pos = d.end()
                    else:
                        pos = header(d.end())
            clean = False
        elif kind == "has":
            arg = _HAS_ARG_RE.match(text, pos)
            if arg is not None:
                lone = _MACRO_NAME_RE.match(text, arg.end())
                if lone is not None and _HEADER_NAME_RE.match(text, arg.end()) is None:
                    ident = lone.group().decode("utf-8", "surrogateescape")
                    if start < define_end and define_params is not None and ident in define_params:
                        found.append((_HAS_WRAPPER, define_name))  # ``#define W(x) __has_include(x)``
                    else:
                        found.append((_COMPUTED, ident))  # ``__has_include(MACRO)``
                    pos = lone.end()
                else:
                    pos = header(arg.end())
            clean = False
        elif kind == "imp":
            # C++20 header units (``import <x.h>;``); a named module (``import m;``) reads no header.
            rest = _SKIP_RE.match(text, pos)
            after = rest.end() if rest is not None else pos
            if _HEADER_NAME_RE.match(text, after) is not None:
                pos = header(after)
            clean = False
        else:  # a string, character or number literal
            clean = False


def _same_realpaths(real_checks: tuple[tuple[str, str], ...]) -> bool:
    """True if every directory still resolves where it did (no symlink on the way was retargeted).

    Exactly ``os.path.realpath(directory) == real`` for each, but a directory recorded as its own
    real path (the common case) is checked by an ``lstat`` of each of its components, each
    component shared by several directories looked at once: ``realpath`` of a normalized absolute
    path with no symbolic link on the way is that path. Where a link is found, ``realpath`` decides.
    """
    realpath = os.path.realpath
    no_link: dict[str, bool] = {"/": True}  # directory -> no component of it is a symbolic link
    for directory, real in real_checks:
        if directory != real or not _is_plain_absolute(directory) or not _no_link_on_the_way(directory, no_link):
            if realpath(directory) != real:
                return False
    return True


def _is_plain_absolute(path: str) -> bool:
    """Absolute, normalized, and not ``//``-rooted: what ``realpath`` returns unchanged when nothing is a link."""
    return path.startswith("/") and not path.startswith("//") and os.path.normpath(path) == path


def _no_link_on_the_way(path: str, no_link: dict[str, bool]) -> bool:
    """No component of ``path`` (absolute, normalized) is a symbolic link: one ``lstat`` per new component."""
    found = no_link.get(path)
    if found is None:
        parent = path.rpartition("/")[0] or "/"
        found = _no_link_on_the_way(parent, no_link)
        if found:
            try:
                found = not stat.S_ISLNK(os.lstat(path).st_mode)
            except OSError:
                found = True  # as realpath: a component it cannot lstat is taken as it is
        no_link[path] = found
    return found


def _parse_includes(data: bytes) -> tuple[tuple[int, str], ...]:
    """Every include any reading of ``data`` the compiler may take names (a union: digest more, never less)."""
    toggles = []
    if b"??" in data and _TRIGRAPH_RE.search(data):
        toggles.append("trigraphs")
    if _LENIENT_SPLICE_RE.search(data):
        toggles.append("lenient_splice")
    if b"\r" in data.replace(b"\r\n", b""):
        toggles.append("cr_newline")
    found: dict[tuple[int, str], None] = {}
    for mask in range(1 << len(toggles)):
        flags = {name: bool(mask >> i & 1) for i, name in enumerate(toggles)}
        text = _phases_1_2(
            data,
            trigraphs=flags.get("trigraphs", False),
            lenient_splice=flags.get("lenient_splice", False),
            cr_newline=flags.get("cr_newline", True),
        )
        found.update(dict.fromkeys(_scan_directives(text)))
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


def _file_info(path: str, sig: Signature, *, parse: bool = True) -> _FileInfo | None:
    """Digest and include list of a regular file, memoized by its stat signature.

    Streamed: never more than ``MAX_HEADER_BYTES`` read (``_TOO_BIG`` past it). ``parse=False``
    (a directory walk's files) hashes in chunks and keeps no text; its memo entry has no includes,
    so a later include of the same file parses it then.
    """
    if sig is None or sig[0] != "f":
        return None
    if sig[2] > MAX_HEADER_BYTES:
        return _TOO_BIG
    cached = _file_memo.get(path)
    if cached is not None and cached[0] == sig and (cached[2] or not parse):
        return cached[1]
    hasher = hashlib.sha256(usedforsecurity=False)
    chunks: list[bytes] = []
    size = 0
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(_HASH_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_HEADER_BYTES:
                    return _TOO_BIG  # grew past the bound while we read it
                hasher.update(chunk)
                if parse:
                    chunks.append(chunk)
    except OSError:
        return None
    _count_hashed()
    info = _FileInfo(hasher.digest(), _parse_includes(b"".join(chunks)) if parse else ())
    after = _signature(path)
    if after == sig and not _is_racy(sig):  # settled and not rewritten while we read it
        with _memo_lock:
            if len(_file_memo) >= MAX_MEMO_FILES:
                _file_memo.clear()
            _file_memo[path] = (sig, info, parse)
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
    roles = [(f"I{i}", os.path.abspath(d)) for i, d in enumerate(_as_list(getattr(options, "include_path", None)))]
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


class _Scan:
    """One walk of the include graph, collecting the digest stream, the paths probed and the files read.

    Paths are resolved as the OS resolves them (a symlinked directory followed before
    ``..``): an includer's directory is its ``realpath``, recorded so a retargeted
    symlink invalidates the memo, and the textual ``normpath`` reading is digested too.
    ``portable`` names directories and absolute spellings by role (see the module
    docstring); otherwise the stream is the location-bound one, byte for byte as before.
    """

    def __init__(self, roles: Sequence[tuple[str, str]], source_dir: str | None, *, portable: bool) -> None:
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
        self.defines: dict[str, set[str]] = {}  # object-like macros seen: name -> every value
        self.wrappers: set[str] = set()  # function-like macros that are ``__has_include`` of a parameter
        self.wraps: set[tuple[str, str]] = set()  # (macro, macro it calls with its parameter)
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
        sig = self.checks[path] = _signature(path)
        if _is_racy(sig):
            self.racy = True
        return sig

    def realpath(self, directory: str) -> str:
        """Where the OS takes ``directory``; remembered, so a warm call sees a retargeted symlink."""
        real = self.real_checks.get(directory)
        if real is None:
            real = self.real_checks[directory] = os.path.realpath(directory)
        return real

    def locate(self, directory: str) -> tuple[str, str]:
        """``(role, path relative to it)`` of a real directory; ``("abs", directory)`` under no root.

        An include directory first (an exact match before a parent, as :meth:`dir_tag`),
        then the source's directory.
        """
        for i, d in enumerate(self.real_include_dirs):
            if directory == d:
                return f"I{i}", ""
        for i, d in enumerate(self.real_include_dirs):
            if directory.startswith(d.rstrip(os.sep) + os.sep):
                return f"I{i}", os.path.relpath(directory, d).replace(os.sep, "/")
        source = self.real_source_dir
        if source is not None:
            if directory == source:
                return "source", ""
            if directory.startswith(source.rstrip(os.sep) + os.sep):
                return "source", os.path.relpath(directory, source).replace(os.sep, "/")
        cwd = self.cwd_real
        if directory == cwd:
            return "cwd", ""
        if directory.startswith(cwd.rstrip(os.sep) + os.sep):
            return "cwd", os.path.relpath(directory, cwd).replace(os.sep, "/")
        return "abs", directory

    def dir_tag(self, directory: str) -> str:
        """How a (real) directory is named in the digest: by role and relative path where it can be."""
        if self.portable:
            role, rel = self.locate(directory)
            if role == "abs":
                self.path_free = False
                return directory
            return f"{role}:{rel}" if rel else role
        # location-bound: as before, by include-path index or relative to one, else absolute
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

    def add_file(self, label: str, path: str, *, follow: bool = True) -> _FileInfo | None:
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
        include path; an angle one on the include path only. ``_PRE_INCLUDE``: the working directory, then
        the include path."""
        shown = self.spelled(spelling)
        self.emit("include", f"{kind}:{shown}".encode("utf-8", "surrogateescape"))
        if os.path.isabs(spelling):
            candidates = [("abs", "")]
        else:
            candidates = []
            if kind == _PRE_INCLUDE:
                candidates.append(("cwd", os.getcwd()))
            elif kind == _QUOTE and includer_dir is not None:
                candidates.append((includer_tag, includer_dir))
            candidates.extend((f"I{i}", d) for i, d in enumerate(self.include_dirs))
        found = False
        for tag, directory in candidates:
            path = os.path.join(directory, spelling) if directory else spelling
            if self.add_file(f"found:{tag}", path):  # as the OS opens it
                found = True
            textual = os.path.normpath(path)
            if textual != path and self.realpath(os.path.dirname(textual)) != self.realpath(os.path.dirname(path)):
                # ``..`` read as text lands elsewhere: digest that file too (more, never less)
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
        if kind in (_QUOTE, _ANGLE):
            self.resolve(kind, spelling, includer_dir, includer_tag)
        elif kind == _COMPUTED:
            if spelling:
                self.pending.setdefault((spelling, includer_dir, includer_tag), set())
            else:
                self.computed(includer_dir, includer_tag)
        elif kind == _DEFINE:
            name, _, value = spelling.partition("\n")
            self.defines.setdefault(name, set()).add(value)
        elif kind == _HAS_WRAPPER:
            self.wrappers.add(spelling)
        elif kind == _WRAPS:
            macro, _, callee = spelling.partition("\n")
            self.wraps.add((macro, callee))
        elif kind == _CALL:
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
            self._close_wrappers()
            for fn, arg, own_dir, tag in sorted(self.calls, key=repr):
                if fn in self.wrappers:  # ``W(MACRO)`` where ``W(x)`` is ``__has_include(x)``
                    self.pending.setdefault((arg, own_dir, tag), set())
            for (name, own_dir, tag), done in sorted(self.pending.items(), key=lambda item: repr(item[0])):
                expansions = self.expand(name)
                if expansions is None:
                    continue  # not (yet) resolvable: if it stays so, the directories count (finish)
                for kind, spelling in sorted(expansions - done):
                    done.add((kind, spelling))
                    self.emit("computed-as", f"{name}:{kind}:{spelling}".encode("utf-8", "surrogateescape"))
                    self.resolve(kind, spelling, own_dir, tag)
            if not self.queue:
                break
        for (name, own_dir, tag), done in sorted(self.pending.items(), key=lambda item: repr(item[0])):
            if self.expand(name) is None:
                self.computed(own_dir, tag)

    def _close_wrappers(self) -> None:
        """A macro calling a ``__has_include`` wrapper with its parameter is one too."""
        grown = True
        while grown:
            grown = False
            for macro, callee in self.wraps:
                if callee in self.wrappers and macro not in self.wrappers:
                    self.wrappers.add(macro)
                    grown = True

    def expand(self, name: str) -> set[tuple[int, str]] | None:
        """Every header name ``#include name`` can expand to, by every definition the scan has seen;
        None when one of them cannot be read (a function-like macro, ``##``, too many readings)."""
        out: set[tuple[int, str]] = set()
        stack = [(name, 0)]
        while stack:
            current, depth = stack.pop()
            values = self.defines.get(current)
            if not values or depth > _MAX_EXPANSION_DEPTH:
                return None
            for value in values:
                if value.startswith('"') and value.endswith('"') and len(value) >= 2 and '"' not in value[1:-1]:
                    out.add((_QUOTE, value[1:-1]))
                elif value.startswith("<") and value.endswith(">") and ">" not in value[1:-1]:
                    texts = self.expand_text(value[1:-1].strip(), depth)
                    if texts is None:
                        return None
                    out.update((_ANGLE, t) for t in texts)
                elif _IDENT_RE.fullmatch(value):
                    stack.append((value, depth + 1))
                else:
                    return None
            if len(out) > _MAX_EXPANSIONS:
                return None
        return out

    def expand_text(self, text: str, depth: int) -> set[str] | None:
        """``text`` with each identifier defined as plain text replaced, or not (both are digested)."""
        readings = {""}
        for piece in _IDENT_SPLIT_RE.split(text):
            options = {piece}
            if _IDENT_RE.fullmatch(piece) and piece in self.defines and depth < _MAX_EXPANSION_DEPTH:
                for value in self.defines[piece]:
                    if any(c in value for c in "\"<>#()"):
                        return None
                    inner = self.expand_text(value, depth + 1)
                    if inner is None:
                        return None
                    options.update(inner)
            readings = {r + o for r in readings for o in options}
            if len(readings) > _MAX_EXPANSIONS:
                return None
        return readings

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

    def outcome(self) -> tuple[tuple[tuple[str, str, str], ...], tuple[str, ...]]:
        """The files read as sorted ``(root, path, sha256 hex)`` rows, and the sorted missing spellings."""
        return (tuple(sorted((root, path, digest) for (root, path), digest in self.files.items())),
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


def _libdevice_scan(portable: bool) -> HeaderScan:
    # cuda.pathfinder's public finder: the same file cuda-core's NVVM path links in.
    from cuda.pathfinder import find_bitcode_lib

    path = os.fspath(find_bitcode_lib("device"))
    info = _file_info(path, _signature(path))
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
) -> HeaderScan:
    """The digest covering every file the compile of ``source`` could read, and those files.

    >>> scan = header_scan(src, ProgramOptions(arch="sm_90", include_path=[cccl_dir]))
    >>> scan.headers[0]
    HeaderFile(root='I0', path='cuda/std/__cccl/assert.h', digest='9f0c...')

    ``portable`` (default): the digest names directories by role (``I0``, ``source``)
    and the path relative to it, so the same headers under another root digest the
    same; ``HeaderScan.path_free`` says whether that held everywhere. ``portable=False``:
    the digest :func:`header_digest` returns. The files read are recorded either way and
    memoized with the scan: a warm call re-stats and returns them without reading any.
    ``recheck_s``, ``memo_dir`` and thread-safety as :func:`header_digest`.
    """
    code_type = code_type.lower()
    if code_type == "nvvm":
        return _libdevice_scan(portable) if getattr(options, "use_libdevice", None) else _NOTHING_READ[portable]
    result = _scan(source, options, code_type, recheck_s, portable=portable, memo_dir=memo_dir)
    if result is None:
        return _NOTHING_READ[portable]
    if not result.read_anything:  # then whether a digest is due depends on the options too
        digest = result.digest if needs_header_digest(options, code_type) or result.declined else None
        return HeaderScan(digest, (), result.missing, result.path_free and portable, result.declined)
    # Made once per scan result: a warm call builds nothing.
    hit = _header_scans.get(id(result))
    if hit is not None and hit[0] is result:
        return hit[1]
    files = tuple(itertools.starmap(HeaderFile, result.headers))
    found = HeaderScan(result.digest, files, result.missing, result.path_free and portable, result.declined)
    with _memo_lock:
        if len(_header_scans) >= MAX_MEMO_SCANS:
            _header_scans.clear()
        _header_scans[id(result)] = (result, found)
    return found


#: What header_scan returned for a memoized scan, by the scan result's identity (kept alive here).
_header_scans: dict[int, tuple[_ScanResult, HeaderScan]] = {}


def _scan(
    source: str | bytes,
    options: Any,
    code_type: str,
    recheck_s: float,
    *,
    portable: bool,
    memo_dir: str | os.PathLike[str] | None,
) -> _ScanResult | None:
    """The (memoized) scan of what the compile of ``source`` could read; None when it reads nothing for sure."""
    if code_type != "c++":
        return None  # PTX: the linker reads no headers; cuda-core drops include options there

    if (isinstance(source, str) and "include" not in source and "import" not in source
            and "embed" not in source and "??" not in source
            and ("\\" not in source or not _SPLICE_HINT_RE.search(source))
            and not needs_header_digest(options, code_type)):
        return None  # no directive can read a file, however spelled (the common case, kept cheap)
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
        _command_line_defines(getattr(options, "define_macro", None)),  # computed includes resolve through them
        os.getcwd(),
        portable,
    )
    cached = _memoized(memo_key, recheck_s, memo_dir)
    if cached is not None:
        return cached

    data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else bytes(source)
    roles = path_roles(options)
    pre_includes = tuple(_as_list(getattr(options, "pre_include", None)))
    source_dir = _source_dir(options)
    use_pch = getattr(options, "use_pch", None)
    use_pch_path = os.path.abspath(os.fspath(use_pch)) if isinstance(use_pch, (str, os.PathLike)) else None

    scan = _Scan(roles, source_dir, portable=portable)
    source_real = scan.real_source_dir
    for name, value in _command_line_defines(getattr(options, "define_macro", None)):
        scan.defines.setdefault(name, set()).add(value)
    for spelling in pre_includes:
        scan.resolve(_PRE_INCLUDE, spelling, None, "pre_include")
    for kind, spelling in _parse_includes(data):
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
    result = _ScanResult(
        digest, read_anything, tuple(scan.checks.items()), tuple(scan.real_checks.items()), time.monotonic(),
        files, missing, scan.path_free, scan.declined,
    )

    _memoize(memo_key, None if scan.racy else result, memo_dir)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("header scan: %d files read, %d paths probed, %d directory fallbacks",
                     len(scan.visited), len(scan.checks), len(scan.fallback_dirs))
    return result


def _memoized(
    memo_key: tuple[Any, ...], recheck_s: float, memo_dir: str | os.PathLike[str] | None
) -> _ScanResult | None:
    """The scan memoized for ``memo_key`` if it still stands, else None (scan again).

    In this process: on inotify's word (plus a stat of what no watch covers), within
    ``recheck_s`` of its last validation, or after validating it again. Else, from
    ``memo_dir``: a scan an earlier process persisted, validated by stat before use.
    """
    global _by_watch
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
    found = _persisted(memo_key, memo_dir)
    if found is None:
        return None
    store, name = found
    loaded = store.load(name, _ScanResult, checked_at=0.0, validations=0)
    if loaded is None or not _revalidate(loaded):
        return None
    _remember(memo_key, loaded)
    return loaded


def _memoize(memo_key: tuple[Any, ...], result: _ScanResult | None, memo_dir: str | os.PathLike[str] | None) -> None:
    """Remember a fresh scan here and in ``memo_dir``; None (a racy scan) forgets ``memo_key`` instead."""
    if result is None:
        _forget(memo_key)
        return
    _remember(memo_key, result)
    found = _persisted(memo_key, memo_dir)
    if found is not None:
        store, name = found
        store.save(name, result)


def _persisted(
    memo_key: tuple[Any, ...], memo_dir: str | os.PathLike[str] | None
) -> tuple[scanmemo.ScanMemoStore, str] | None:
    """The store and file name ``memo_key`` persists under, or None (no ``memo_dir``, or no scanner id)."""
    if memo_dir is None:
        return None
    scanner_id = _scanner_id()
    if scanner_id is None:
        return None
    key = os.fspath(memo_dir)
    store = _memo_stores.get(key)
    if store is None:
        store = _memo_stores.setdefault(key, scanmemo.ScanMemoStore(key))
    return store, scanmemo.memo_name(memo_key, scanner_id)


def _unwatched_unchanged(watch: Subscription) -> bool:
    """The paths no watch covers (an untrusted filesystem, a refused watch), re-stat'ed as before."""
    return (not watch.stat_checks or _unchanged(watch.stat_checks)) and (
        not watch.stat_real_checks or _same_realpaths(watch.stat_real_checks)
    )


def _revalidate(result: _ScanResult) -> bool:
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
                                signature=_signature, signature_of_stat=_signature_of_stat)
        valid = sub.valid
        if valid:
            with _memo_lock:
                raced, result.watch = result.watch, sub  # another thread validating the same scan at once
            if raced is not None:
                raced.release()
    if valid:
        result.checked_at = time.monotonic()
    return valid


def _remember(memo_key: tuple[Any, ...], result: _ScanResult) -> None:
    with _memo_lock:
        if len(_scan_memo) >= MAX_MEMO_SCANS:
            _release_all()
        previous = _scan_memo.get(memo_key)
        _scan_memo[memo_key] = result
    if previous is not None and previous is not result and previous.watch is not None:
        previous.watch.release()


def _forget(memo_key: tuple[Any, ...]) -> None:
    with _memo_lock:
        previous = _scan_memo.pop(memo_key, None)
    if previous is not None and previous.watch is not None:
        previous.watch.release()


def _release_all() -> None:
    """Drop every scan (memo lock held) and release their watches."""
    for result in _scan_memo.values():
        if result.watch is not None:
            result.watch.release()
    _scan_memo.clear()


def _scanner_id() -> bytes | None:
    """The scanner's own code, hashed: a memo persisted by another version of it is never read.

    None (nothing persisted, logged once) where the module's file cannot be read (a zip import).
    """
    global _scanner_id_value
    if _scanner_id_value is None:
        try:
            with open(__file__, "rb") as fh:
                _scanner_id_value = hashlib.sha256(fh.read(), usedforsecurity=False).digest()
        except OSError as exc:
            log_once(logger, "no-scanner-id", logging.INFO, "header scans are not persisted: %s", exc)
            _scanner_id_value = b""
    return _scanner_id_value or None


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
        _header_scans.clear()
        _release_all()
