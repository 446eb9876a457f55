"""STAND-IN for the ``keys`` branch's portable keys: the interface :mod:`.manifest` and :mod:`.explain` code against.

The ``keys`` branch owns this module; the lead takes its version at merge. This
stand-in has exactly the names of that interface and computes the key the way
:func:`tiered_progcache.compile` did before it (cuda-core's ``make_program_cache_key``,
with :func:`~tiered_progcache.headers.header_digest` mixed into ``extra_digest``), so
keys are never portable here (``portable`` is always False). What it adds is the
description of the key a manifest records: the headers the digest covers, by include
root and relative path, and the option strings with include directories as role
tokens (``--include-path=I0``), so no absolute path of this machine is recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

from cuda.core import ProgramOptions
from cuda.core.utils import make_program_cache_key

from . import headers as _headers
from .headers import header_digest

__all__ = ["CompileKey", "HeaderFile", "compile_key"]


@dataclasses.dataclass(frozen=True)
class HeaderFile:
    """One header a key's digest covers. Immutable."""

    root: str  # role of the include root: "I0", "I1", ..., "source", "abs"
    path: str  # path relative to that root ("cuda/std/__type_traits/x.h")
    digest: str  # sha256 hex of the file's bytes


@dataclasses.dataclass(frozen=True)
class CompileKey:
    """A cache key and what it was made of. Immutable."""

    key: bytes
    portable: bool
    headers: tuple[HeaderFile, ...]  # every header the digest covers, sorted; () when none
    missing: tuple[str, ...]  # include spellings found nowhere (NVRTC built-ins)
    options: tuple[str, ...]  # option strings as keyed (role tokens instead of paths), in order
    header_digest: bytes | None


def _combine(user_digest: bytes | None, headers: bytes | None) -> bytes | None:
    if headers is None:
        return user_digest
    if user_digest is None:
        return headers
    h = hashlib.sha256(usedforsecurity=False)
    for part in (bytes(user_digest), headers):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


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
) -> CompileKey:
    """The key of one compile and its parts. The stand-in ignores ``portable`` (its keys never are)."""
    digest = header_digest(source, options, code_type, recheck_s=recheck_s)
    key = make_program_cache_key(
        code=source,
        code_type=code_type,
        options=options,
        target_type=target_type,
        name_expressions=tuple(name_expressions),
        extra_digest=_combine(extra_digest, digest),
    )
    include_dirs = tuple(os.path.abspath(p) for p in _headers._as_list(getattr(options, "include_path", None)))
    files, missing = _header_files(source, options, code_type, digest, include_dirs)
    return CompileKey(
        key=key,
        portable=False,
        headers=files,
        missing=missing,
        options=_keyed_options(options, code_type, target_type, include_dirs),
        header_digest=digest,
    )


# -- what the options were, without this machine's paths ----------------------------------------------

#: ProgramOptions fields the linker reads for PTX input (cuda-core keys only these for code_type "ptx").
_LINKER_FIELDS = (
    "arch", "max_register_count", "time", "link_time_optimization", "debug", "lineinfo", "ftz",
    "prec_div", "prec_sqrt", "fma", "split_compile", "ptxas_options", "no_cache",
)  # fmt: skip


def _keyed_options(options: ProgramOptions, code_type: str, target_type: str, include_dirs: tuple[str, ...]) -> tuple[str, ...]:
    code_type = code_type.lower()
    if code_type == "ptx":
        return tuple(
            f"{name}={getattr(options, name)!r}"
            for name in _LINKER_FIELDS
            if getattr(options, name, None) not in (None, False)
        )
    backend = "nvvm" if code_type == "nvvm" else "nvrtc"
    out = []
    for raw in options.as_bytes(backend, target_type.lower()):
        text = bytes(raw).decode("utf-8", "surrogateescape")
        flag, eq, value = text.partition("=")
        if eq and flag == "--include-path":
            absolute = os.path.abspath(value)
            role = next((f"I{i}" for i, d in enumerate(include_dirs) if d == absolute), None)
            text = f"{flag}={role}" if role is not None else text
        out.append(text)
    return tuple(out)


# -- which headers the digest covered ---------------------------------------------------------------


class _RecordingScan(_headers._Scan):
    """The header scan, noting each file it hashed (path, digest) and each include found nowhere."""

    def __init__(self, include_dirs: Sequence[str]) -> None:
        super().__init__(include_dirs)
        self.files: dict[str, str] = {}
        self.missing: list[str] = []
        self._opening: str | None = None
        self._spelling = ""
        self._tree = ""

    def add_file(self, label: str, path: str, *, follow: bool = True) -> bool:
        self._opening = path
        try:
            return super().add_file(label, path, follow=follow)
        finally:
            self._opening = None

    def emit(self, label: str, payload: bytes) -> None:
        if self._opening is not None and (label.startswith("found") or label == "use_pch"):
            self.files.setdefault(self._opening, payload.hex())
        elif label == "include":
            self._spelling = payload.decode("utf-8", "surrogateescape").partition(":")[2]
        elif label == "missing":
            self.missing.append(self._spelling)
        elif label == "tree":
            self._tree = payload.decode("utf-8", "surrogateescape")
        elif label == "tree-file":
            rel, _, digest = payload.rpartition(b"\0")
            directory = next((d for d, tag in self.fallback_dirs.items() if tag == self._tree), "")
            self.files.setdefault(os.path.join(directory, rel.decode("utf-8", "surrogateescape")), digest.hex())
        super().emit(label, payload)


_memo: dict[tuple[Any, ...], tuple[tuple[HeaderFile, ...], tuple[str, ...]]] = {}
_memo_lock = threading.Lock()
_MAX_MEMO = 4096


def _header_files(
    source: str | bytes, options: Any, code_type: str, digest: bytes | None, include_dirs: tuple[str, ...]
) -> tuple[tuple[HeaderFile, ...], tuple[str, ...]]:
    """The headers the digest covers, by role; memoized by the digest (a rescan only when it changed)."""
    if digest is None:
        return (), ()
    code_type = code_type.lower()
    source_dir = _headers._source_dir(options)
    memo_key = (digest, include_dirs, source_dir, code_type)
    with _memo_lock:
        cached = _memo.get(memo_key)
    if cached is not None:
        return cached
    if code_type == "nvvm":
        from cuda.pathfinder import find_bitcode_lib

        path = os.fspath(find_bitcode_lib("device"))
        with open(path, "rb") as fh:
            found = {path: hashlib.sha256(fh.read(), usedforsecurity=False).hexdigest()}
        missing: list[str] = []
    else:
        data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else bytes(source)
        scan = _RecordingScan(include_dirs)
        source_real = scan.realpath(source_dir) if source_dir is not None else None
        for spelling in _headers._as_list(getattr(options, "pre_include", None)):
            scan.resolve(_headers._QUOTE, spelling, source_real, "source")
        for kind, spelling in _headers._parse_includes(data):
            if kind == _headers._COMPUTED:
                scan.computed(source_real, "source")
            else:
                scan.resolve(kind, spelling, source_real, "source")
        scan.drain()
        scan.hash_fallback_dirs()
        found, missing = scan.files, scan.missing
    roots = [(f"I{i}", d) for i, d in enumerate(include_dirs)]
    if source_dir is not None:
        roots.append(("source", source_dir))
    files = sorted({_role(path, roots, file_digest) for path, file_digest in found.items()},
                   key=lambda h: (h.root, h.path))  # fmt: skip
    result = (tuple(files), tuple(sorted(set(missing))))
    with _memo_lock:
        if len(_memo) >= _MAX_MEMO:
            _memo.clear()
        _memo[memo_key] = result
    return result


def _role(path: str, roots: list[tuple[str, str]], digest: str) -> HeaderFile:
    absolute = os.path.normpath(os.path.abspath(path))
    for role, root in roots:
        real_root = os.path.normpath(root)
        if absolute.startswith(real_root.rstrip(os.sep) + os.sep):
            return HeaderFile(role, os.path.relpath(absolute, real_root).replace(os.sep, "/"), digest)
    return HeaderFile("abs", absolute, digest)
