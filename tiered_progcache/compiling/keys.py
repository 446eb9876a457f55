"""How ``compile()`` keys a compile: by what the compiler reads, not where it lives.

cuda-core's ``make_program_cache_key`` hashes the option strings, and those carry
every include directory, pre-include, PCH file and a source name with a directory
as an absolute path: a CI runner whose CCCL lies in ``/home/runner/.venv/...`` and a
node whose CCCL lies in ``/opt/venv/...`` get different keys for the same headers.
A portable key (the default) still goes through ``make_program_cache_key`` (so the
NVRTC version, key schema, code, target, name expressions and every other option are
keyed exactly as cuda-core keys them) but over a copy of the options in which each
path is replaced by its role:

* ``include_path``: ``<tiered-progcache:I0>``, ``<tiered-progcache:I1>``, ... (by position);
* ``pre_include``: an absolute one under a root as ``<tiered-progcache:I0>/rel/x.h``, a
  relative one as spelled;
* ``name`` with a directory: ``<tiered-progcache:source>/kernel.cu``;
* ``use_pch``: ``<tiered-progcache:use_pch>`` (the file's bytes are digested); ``pch_dir``:
  ``<tiered-progcache:pch_dir>``;
* ``use_bundled_headers``: ``--use-bundled-headers=<tiered-progcache:bundled>`` (cuda-core
  puts that directory under the user's cache directory; NVRTC installs its own headers
  there, which follow the NVRTC version, which is keyed);

and the ``extra_digest`` is the portable header digest (:func:`.headerscan.header_scan`):
each header reachable through those roots by its role, its path relative to the root and
its content. Same headers under another root: same key; one byte changed in a reachable
header: another key.

What stays location-bound (``CompileKey.portable`` is False):

* ``portable=False`` (``compile(portable_keys=False)``): the key is the one this
  package made before portable keys, byte for byte.
* a compile with debug information (``debug``, ``lineinfo``, ``numba_debug``): the
  binary names every source and header by absolute path for the debugger and the
  profiler, which must find them on this host, so such a compile is keyed by path.
* a file the compile reads that lies under no root (an absolute ``#include`` or
  ``pre_include`` outside every include directory, a ``..`` or a symlink leading out of
  every root): its absolute path stays in the key.

Accepted: ``__FILE__`` in release code (CCCL's assertions) embeds the path the compiler
found a file at, so a hit may hold another host's paths in such strings; they are text
only, and nothing reads them unless an assertion fires.

Cost: a ``compile()`` hit keys on every call, so the copy and its option strings are
remembered per options object and reused while each of its fields is the very object
it was (mutable ones: the same ``repr``). That relies on ``ProgramOptions.as_bytes``
depending on the fields alone; the one exception known, the bundled-headers directory,
is replaced by its role.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import cachetools
from cuda.core import ProgramOptions
from cuda.core.utils import make_program_cache_key

from .headermemo import ScanResult
from .headerscan import HeaderFile, HeaderScan, header_scan, path_roles, role_relative, role_token

__all__ = ["CompileKey", "HeaderFile", "ScanBasis", "carries_debug_info", "compile_key", "keyed_by_role", "key_for"]

_BUNDLED_FLAG = b"--use-bundled-headers="
_BUNDLED_OPTION = _BUNDLED_FLAG + role_token("bundled").encode()
_BUNDLED_OPTION_TEXT = _BUNDLED_OPTION.decode()
#: The backend whose option strings cuda-core's key hashes, per code type.
_BACKENDS = {"c++": "nvrtc", "nvvm": "nvvm"}


@dataclasses.dataclass(frozen=True)
class CompileKey:
    """The key of one compile and what went into it. Immutable.

    ``key`` addresses the cache; ``portable`` is False when it is location-bound (asked
    for, a compile with debug information, or a file under no root); ``headers`` every
    file the header digest covers, sorted; ``missing`` the include spellings found
    nowhere (NVRTC's built-ins), sorted; ``options`` the option strings as keyed (role
    tokens in place of paths; ``()`` for PTX, whose linker options cuda-core keys field
    by field); ``header_digest`` what was mixed into ``extra_digest`` (None: no file read).
    """

    key: bytes
    portable: bool
    headers: tuple[HeaderFile, ...]
    missing: tuple[str, ...]
    options: tuple[str, ...]
    header_digest: bytes | None
    #: why what the compile reads cannot be known (``HeaderScan.declined``): ``compile()`` does not cache it
    declined: str | None = None
    #: the scan it came from, where it read files (what :mod:`.direct` records a header set from)
    basis: ScanBasis | None = dataclasses.field(default=None, compare=False, repr=False)
    #: the chain was just asked for its direct manifest and has none: no node recorded a compile of this source
    #: and these options, so ``compile()`` leaves the shared lookup to the look under its flight's lock
    unrecorded: bool = dataclasses.field(default=False, compare=False)


@dataclasses.dataclass(frozen=True)
class ScanBasis:
    """The scan a key came from, the working directory it ran in, and whether paths were keyed by role."""

    result: ScanResult
    cwd: str
    by_role: bool


class _KeyedOptions(ProgramOptions):
    """A copy of the caller's options, for keying only (never handed to a ``Program``). Read-only once made.

    Made without ``__init__`` (``__post_init__`` would probe the device for a missing
    ``arch``). Makes its option strings once per backend and target (cuda-core's key
    asks for them on every call), with the bundled-headers role in place of that
    directory, and keeps them for ``CompileKey.options``.
    """

    #: Put the bundled-headers role in place of the directory cuda-core names.
    tpc_bundled_by_role = False

    def tpc_start(self) -> None:
        """Set up the per-copy store of option strings (the copy is made without ``__init__``)."""
        self.tpc_made: dict[tuple[Any, Any], tuple[list[bytes], tuple[str, ...]]] = {}

    def as_bytes(self, backend: Any, target_type: Any = None) -> list[bytes]:
        made = self.tpc_made.get((backend, target_type))
        if made is None:
            option_bytes = ProgramOptions.as_bytes(self, backend, target_type)
            if self.tpc_bundled_by_role:
                option_bytes = [_BUNDLED_OPTION if o.startswith(_BUNDLED_FLAG) else o for o in option_bytes]
            made = self.tpc_made[(backend, target_type)] = (option_bytes, tuple(map(_decode, option_bytes)))
        return list(made[0])

    def tpc_strings(self, backend: str, target_type: str) -> tuple[str, ...]:
        """The option strings made for ``backend`` and ``target_type``; () if none were asked for."""
        made = self.tpc_made.get((backend, target_type))
        return () if made is None else made[1]


def _decode(option: bytes) -> str:
    return option.decode("utf-8", "surrogateescape")


def carries_debug_info(options: ProgramOptions) -> bool:
    """True when the compile embeds source paths for a debugger or profiler: keyed by path then."""
    return bool(options.debug or options.lineinfo or options.numba_debug)


def _combine(user_digest: bytes | None, headers: bytes | None) -> bytes | None:
    """The caller's ``extra_digest`` and the header digest as one; either alone when the other is None."""
    if headers is None:
        return user_digest
    if user_digest is None:
        return headers
    h = hashlib.sha256(usedforsecurity=False)
    for part in (bytes(user_digest), headers):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


def _emitted(value: object) -> bool:
    """Whether cuda-core emits a str-or-sequence option (``include_path``, ``pre_include``) at all."""
    return isinstance(value, str) or (isinstance(value, Sequence) and len(value) > 0)


@dataclasses.dataclass(frozen=True)
class _Tokenized:
    """A memoized copy of one caller's options with roles in place of paths, and what it depended on."""

    options: ProgramOptions  # held, so its id (the memo key) is not reused while remembered
    values: tuple[Any, ...]  # its fields' objects when copied: each must still be the very same object
    contents: tuple[tuple[int, str], ...]  # (position, repr) of each mutable field value: [1] is not [1.0]
    cwd: str | None  # the working directory roles were read in (None: they were not read)
    keyed: _KeyedOptions
    path_free: bool

    def still_matches(self, values: tuple[Any, ...]) -> bool:
        """Whether ``options`` still holds what it held when copied (no field reassigned or mutated)."""
        if len(values) != len(self.values) or not all(map(operator.is_, values, self.values)):
            return False
        if any(repr(values[i]) != held for i, held in self.contents):
            return False
        return self.cwd is None or os.getcwd() == self.cwd


#: Tokenized copies by id(options): a hit costs a look at each field instead of a copy and ``as_bytes``.
#: Copies remembered; past this the least recently used is forgotten.
MAX_MEMO_OPTIONS = 1024
# An LRU (reads reorder it): read and written under _tokenized_lock.
_tokenized: cachetools.LRUCache[int, _Tokenized] = cachetools.LRUCache(MAX_MEMO_OPTIONS)
_tokenized_lock = threading.Lock()


def _keyed_options(options: ProgramOptions, *, portable: bool) -> tuple[_KeyedOptions, bool]:
    """A copy of ``options`` with every path replaced by its role (``portable``), and whether that left none.

    Portable copies are memoized per options object while none of its fields changes;
    a location-bound copy is made fresh (its bundled-headers directory follows the environment).
    """
    if not portable:
        return _copy(options), False
    values = tuple(vars(options).values())
    with _tokenized_lock:
        memo = _tokenized.get(id(options))
    if memo is not None and memo.options is options and memo.still_matches(values):
        return memo.keyed, memo.path_free
    keyed = _copy(options)
    path_free, read_cwd = _put_roles(keyed, options)
    contents = tuple((i, repr(v)) for i, v in enumerate(values) if not isinstance(v, _IMMUTABLE))
    memo = _Tokenized(options, values, contents, os.getcwd() if read_cwd else None, keyed, path_free)
    with _tokenized_lock:
        _tokenized[id(options)] = memo
    return keyed, path_free


_IMMUTABLE = (type(None), bool, int, float, str, bytes)


def _copy(options: ProgramOptions) -> _KeyedOptions:
    keyed = _KeyedOptions.__new__(_KeyedOptions)
    keyed.__dict__.update(vars(options))  # every field as the caller set it, no __post_init__
    keyed.tpc_start()
    return keyed


def _put_roles(keyed: _KeyedOptions, options: ProgramOptions) -> tuple[bool, bool]:
    """Replace each path in ``keyed`` by its role; (no path left, the working directory was read)."""
    path_free, read_cwd = True, False
    include_path = options.include_path
    if _emitted(include_path):
        count = 1 if isinstance(include_path, str) else len(include_path)
        keyed.include_path = [role_token(f"I{i}") for i in range(count)]
    pre_include = options.pre_include
    if _emitted(pre_include):
        spellings = [os.fspath(p) for p in ([pre_include] if isinstance(pre_include, str) else pre_include)]
        if any(os.path.isabs(p) for p in spellings):
            read_cwd = True  # relative include directories and a name without one follow it
            roles = path_roles(options)
            named = []
            for spelling in spellings:
                role_named = role_relative(spelling, roles) if os.path.isabs(spelling) else spelling
                if role_named is None:  # outside every root: keyed where it lies
                    path_free = False
                    role_named = spelling
                named.append(role_named)
            keyed.pre_include = named
    name = options.name
    if isinstance(name, str) and os.path.dirname(name):
        keyed.name = f"{role_token('source')}/{os.path.basename(name)}"
    if isinstance(options.use_pch, (str, os.PathLike)):
        keyed.use_pch = role_token("use_pch")
    if isinstance(options.pch_dir, (str, os.PathLike)):
        keyed.pch_dir = role_token("pch_dir")
    if options.use_bundled_headers:
        keyed.tpc_bundled_by_role = True
    return path_free, read_cwd


def compile_key(
    source: str | bytes,
    code_type: str,
    options: ProgramOptions,
    target_type: str,
    name_expressions: Sequence[str | bytes] = (),
    extra_digest: bytes | None = None,
    *,
    portable: bool = True,
    recheck_s: float = 0.0,
    memo_dir: str | os.PathLike[str] | None = None,
    memo_only: bool = False,
    max_files: int | None = None,
    memoize_scan: bool = True,
) -> CompileKey | None:
    """The key ``compile()`` stores and finds this compile under, and what went into it.

    >>> ck = compile_key(src, "c++", ProgramOptions(arch="sm_90", include_path=[cccl]), "cubin")
    >>> ck.portable, ck.options[-1], ck.headers[0].root
    (True, '--include-path=<tiered-progcache:I0>', 'I0')

    ``portable`` (default): keyed by role and content, not location (module docstring);
    False: the location-bound key, exactly ``make_program_cache_key(options=options,
    extra_digest=...)`` over :func:`.headerscan.header_digest`. ``extra_digest`` is mixed
    with the header digest (only when the compile reads a file, so a plain compile keys
    as ``Program.compile(cache=...)`` does). ``recheck_s`` and ``memo_dir`` (where header
    scans persist for the next process) as for ``header_digest``. ``memo_only``: None where
    no header-scan memo answers and a scan would have to run; ``max_files``: None where the scan
    reads more files than that; ``memoize_scan`` False: a scan run now is left unmemoized.
    Raises what ``make_program_cache_key`` raises for options it refuses to key.
    Thread-safe; reads the working directory and the header files.
    """
    by_role = keyed_by_role(options, code_type, portable)
    cwd = os.getcwd()
    scan = header_scan(source, options, code_type, recheck_s=recheck_s, portable=by_role, memo_dir=memo_dir,
                       memo_only=memo_only, max_files=max_files, memoize_scan=memoize_scan)
    if scan is None:
        return None
    return key_for(source, code_type, options, target_type, name_expressions, extra_digest, scan, by_role, cwd)


def keyed_by_role(options: ProgramOptions, code_type: str, portable: bool) -> bool:
    """Check the arguments :func:`compile_key` checks first; whether its paths are keyed by role."""
    if not isinstance(portable, bool):
        raise TypeError(f"portable must be a bool, got {type(portable).__name__} {portable!r}")
    if not isinstance(options, ProgramOptions):
        raise TypeError(f"options must be a cuda.core ProgramOptions, got {type(options).__name__}")
    if not isinstance(code_type, str):
        raise TypeError(f"code_type must be a str, got {type(code_type).__name__}")
    return portable and not carries_debug_info(options)


def key_for(
    source: str | bytes,
    code_type: str,
    options: ProgramOptions,
    target_type: str,
    name_expressions: Sequence[str | bytes],
    extra_digest: bytes | None,
    scan: HeaderScan,
    by_role: bool,
    cwd: str,
) -> CompileKey:
    """The :class:`CompileKey` of a compile whose header scan is ``scan`` (made by scanning, or by :mod:`.direct`)."""
    keyed, options_path_free = _keyed_options(options, portable=by_role)
    key = make_program_cache_key(
        code=source,
        code_type=code_type,
        options=keyed,
        target_type=target_type,
        name_expressions=name_expressions,
        extra_digest=_combine(extra_digest, scan.digest),
    )
    backend = _BACKENDS.get(code_type.lower())  # cuda-core asks for these option strings; PTX: none
    keyed_strings = keyed.tpc_strings(backend, target_type.lower()) if backend is not None else ()
    if keyed.tpc_bundled_by_role and backend == "nvrtc" and _BUNDLED_OPTION_TEXT not in keyed_strings:
        options_path_free = False  # cuda-core spelled that option otherwise: its directory stayed
    return CompileKey(
        key=key,
        portable=by_role and scan.path_free and options_path_free,
        headers=scan.headers,
        missing=scan.missing,
        options=keyed_strings,
        header_digest=scan.digest,
        declined=scan.declined,
        basis=None if scan.result is None else ScanBasis(scan.result, cwd, by_role),
    )


def keyed_options(options: ProgramOptions, by_role: bool) -> ProgramOptions:
    """The copy of ``options`` cuda-core's key is made over (roles in place of paths where ``by_role``)."""
    return _keyed_options(options, portable=by_role)[0]


def combine_digests(user_digest: bytes | None, digest: bytes | None) -> bytes | None:
    """The caller's ``extra_digest`` and another digest as one (as the header digest is mixed in)."""
    return _combine(user_digest, digest)
