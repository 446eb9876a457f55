"""Entry manifests: a small JSON document beside each binary saying what it was compiled from, by whom, how long.

:func:`tiered_progcache.compiling.compile` stores one after every compile it runs, under
:func:`manifest_key`, through the cache's ordinary write path (so on every tier, and
on a shared tier inside the same signed, digested envelope as any entry). Its entry
name follows from the binary's entry name alone (:func:`manifest_name`), so a listing
is enough to pair them (``tiered-progcache ls --long``, ``explain NAME``).

A manifest is information, never input: nothing it says changes what ``compile()``
returns, and :func:`decode_manifest` rejects anything that is not exactly the
documented shape (:class:`ManifestError`). It holds no environment, no settings, no
signing key, no remote options and no absolute path of the machine: include
directories are role tokens (``I0``, ``I1``...), also for a path-keyed compile
(``portable_keys=False``, ``debug``/``lineinfo``), whose key holds the paths; a path under
no root (an option's value, a header included by absolute path) is written
``<redacted:sha256:...>``, the first 16 hex digits of its digest, so two manifests still
tell different paths apart. ``Program.compile(cache=...)`` writes none.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .._cudacore import key_schema_version
from ..version import VERSION
from ..stores.envelope import max_stored_bytes
from ..errors import one_line
from .headerscan import path_roles, role_relative
from .keys import CompileKey, HeaderFile
from ..stores.kinds import MANIFEST_FORMAT
from ..stores.store import (EntryStore, StoredEntry, companion_keys, entry_name, is_entry_name, manifest_name,
                            read_in_batches)

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "CompileInputs",
    "Manifest",
    "ManifestError",
    "Provenance",
    "build_manifest",
    "compile_inputs",
    "compile_seconds_of",
    "compiler_of",
    "decode_manifest",
    "encode_manifest",
    "manifest_columns",
    "manifest_key",
    "manifest_name",
    "read_manifests",
    "read_shared_manifests",
]

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
#: The most bytes a manifest takes. A kernel including ``<cub/cub.cuh>`` records 1795 headers in
#: 209004 bytes (``benchmarks/bench_manifest_size.py``); past the bound the header list is left out
#: (``headers_omitted`` counts it), and a manifest still over it is not written. Readers refuse anything larger, and skip listed entries larger than an
#: envelope of this size without reading them.
MAX_MANIFEST_BYTES = 256 * 1024
#: Longest string any field may hold (a header path, an option, a name expression).
MAX_FIELD_CHARS = 4096

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
#: What a manifest's time must look like when read: what :data:`_TIME_FORMAT` writes (not strptime, whose
#: first call in a process costs a fresh node's first hit milliseconds).
_TIME_PATTERN = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})Z")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """A stored manifest that is not a well-formed manifest of this version (corrupt, forged, foreign)."""


# -- the document ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompileInputs:
    """What the key of one compile was made of, as a manifest records it. Immutable; no absolute paths.

    ``options`` are the option strings as keyed (``-arch=sm_80``, ``--include-path=I0``);
    ``headers`` every header the key covers (``headers_omitted`` counts any left out to
    keep the manifest within :data:`MAX_MANIFEST_BYTES`); ``missing`` includes found
    nowhere (NVRTC built-ins); ``kernels`` the kernel names the source declares
    (``__global__`` functions, PTX ``.entry``), used to find similar entries;
    ``extra_digest_sha256`` the sha256 of the caller's ``extra_digest``, if any.
    """

    key_schema: int
    portable: bool
    source_sha256: str
    code_type: str
    target: str
    arch: str | None
    program_name: str | None
    options: tuple[str, ...]
    compiler: str
    compiler_version: str
    headers: tuple[HeaderFile, ...]
    headers_omitted: int
    missing: tuple[str, ...]
    name_expressions: tuple[str | bytes, ...]
    kernels: tuple[str, ...]
    extra_digest_sha256: str | None


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Who wrote an entry and when. ``written_at`` is ``YYYY-MM-DDTHH:MM:SSZ`` (UTC); ``packages`` name -> version."""

    host: str
    written_at: str
    packages: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """One entry's manifest: the entry it describes, its inputs, its compile time, its provenance. Immutable."""

    entry: str
    inputs: CompileInputs
    compile_seconds: float
    provenance: Provenance

    def as_dict(self) -> dict[str, Any]:
        """The stored JSON document as a dict (what ``explain NAME --json`` prints)."""
        return _document(self)

    def lines(self, max_headers: int | None = None) -> tuple[str, ...]:
        """The manifest for people, one field a line (what ``tiered-progcache explain NAME`` prints).

        ``max_headers``: list at most that many headers (a CUB kernel records ~1,800), then how
        many more. ``missing`` shows only what is spelled like a header (see :func:`header_spellings`).
        """
        i, p = self.inputs, self.provenance
        packages = ", ".join(f"{name} {version}" for name, version in p.packages)
        roots: dict[str, int] = {}
        for h in i.headers:
            roots[h.root] = roots.get(h.root, 0) + 1
        per_root = ", ".join(f"{root}: {n}" for root, n in sorted(roots.items()))
        omitted = f", {i.headers_omitted} more not recorded" if i.headers_omitted else ""
        out = [
            f"entry         {self.entry}",
            f"written by    {p.host} at {p.written_at}",
            f"packages      {packages}",
            f"compiled in   {self.compile_seconds:.3f} s by {i.compiler} {i.compiler_version}",
            f"compile       {i.code_type} -> {i.target}, arch {i.arch or '-'}",
            f"source        sha256 {i.source_sha256}",
            f"options       {' '.join(i.options) or '-'}",
            f"program name  {i.program_name or '-'}",
            f"name exprs    {', '.join(_shown(n) for n in i.name_expressions) or '-'}",
            f"kernels       {', '.join(i.kernels) or '-'}",
            f"extra digest  {'sha256 ' + i.extra_digest_sha256 if i.extra_digest_sha256 else '-'}",
            f"key           cuda-core key schema {i.key_schema}, {'portable' if i.portable else 'not portable'}",
            f"headers       {len(i.headers)}{f' ({per_root})' if per_root else ''}{omitted}",
        ]
        shown = i.headers if max_headers is None else i.headers[:max_headers]
        out += [f"  {h.root:<7} {h.path}  {h.digest[:16]}" for h in shown]
        if len(shown) < len(i.headers):
            out.append(f"  ... and {len(i.headers) - len(shown)} more headers (explain --json lists every one)")
        missing = header_spellings(i.missing)
        dropped = len(i.missing) - len(missing)
        out.append(f"missing       {', '.join(missing) or '-'}{f' (+{dropped} not header names)' if dropped else ''}")
        return tuple(out)


#: The C and C++ standard headers spelled without an extension (``<vector>``, ``<cstdint>``).
_STANDARD_HEADERS = frozenset(
    "algorithm any array atomic barrier bit bitset cassert ccomplex cctype cerrno cfenv cfloat charconv chrono "
    "cinttypes ciso646 climits clocale cmath codecvt compare complex concepts condition_variable coroutine csetjmp "
    "csignal cstdalign cstdarg cstdbool cstddef cstdint cstdio cstdlib cstring ctgmath ctime cuchar cwchar cwctype "
    "deque exception execution expected filesystem format forward_list fstream functional future initializer_list "
    "iomanip ios iosfwd iostream istream iterator latch limits list locale map mdspan memory memory_resource mutex "
    "new numbers numeric optional ostream print queue random ranges ratio regex scoped_allocator semaphore set "
    "shared_mutex source_location span spanstream sstream stack stacktrace stdexcept stdfloat stop_token streambuf "
    "string string_view strstream syncstream system_error thread tuple type_traits typeindex typeinfo unordered_map "
    "unordered_set utility valarray variant vector version".split()
)
_HEADER_PATH = re.compile(r"[A-Za-z0-9_+.-]+(?:/[A-Za-z0-9_+.-]+)*")


def header_spellings(missing: Sequence[str]) -> list[str]:
    """The entries of ``missing`` spelled like a header: a path with an extension or a directory, or a
    standard header's name; not a flag (``-Wdeprecated``), a word (``hidden``, ``min``) or an unexpanded
    macro (``__THRUST_DEVICE_SYSTEM_ROOT/...``), which the scanner also records."""
    out = []
    for spelling in missing:
        if spelling in _STANDARD_HEADERS:
            out.append(spelling)
        elif (_HEADER_PATH.fullmatch(spelling) and not spelling.startswith("-") and ("." in spelling or "/" in spelling)
              and not spelling.split("/", 1)[0].startswith("__") and "..." not in spelling):  # fmt: skip
            out.append(spelling)
    return out


def _shown(name: str | bytes) -> str:
    return name if isinstance(name, str) else repr(name)


# -- where it is stored ----------------------------------------------------------------------------


def manifest_key(key: bytes) -> bytes:
    """The cache key the manifest of the entry with cache key ``key`` is stored under (pure)."""
    return companion_keys(bytes(key))[0]


# -- building one ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def compiler_of(code_type: str) -> tuple[str, str]:
    """The compiler that turns ``code_type`` into code here and its version: ``("NVRTC", "13.0")``.

    Through cuda.bindings' public calls; ``"unknown"`` where a library cannot be loaded.
    """
    code_type = code_type.lower()
    try:
        if code_type == "c++":
            from cuda.bindings import nvrtc

            _, major, minor = nvrtc.nvrtcVersion()
            return "NVRTC", f"{major}.{minor}"
        if code_type == "nvvm":
            from cuda.bindings import nvvm

            major, minor = nvvm.version()
            return "NVVM", f"{major}.{minor}"
        from cuda.bindings import nvjitlink

        major, minor = nvjitlink.version()
        return "nvJitLink", f"{major}.{minor}"
    except Exception:  # a missing library: the compile would fail too; the manifest only says so
        return {"c++": "NVRTC", "nvvm": "NVVM"}.get(code_type, "nvJitLink"), "unknown"


@functools.lru_cache(maxsize=None)
def _packages() -> tuple[tuple[str, str], ...]:
    """The versions of the packages that made the entry, from the modules the compile imported: no scan of the
    installed distributions' metadata (1.4 ms of a fresh process's first compile here, more where many are
    installed), and the right answer from a checkout too."""
    from cuda.bindings import __version__ as bindings_version
    from cuda.core import __version__ as core_version

    found = [("tiered-progcache", VERSION), ("cuda-core", str(core_version)), ("cuda-bindings", str(bindings_version)),
             ("python", platform.python_version())]
    return tuple(sorted(found))  # as the stored document (sorted keys) gives them back


_KERNEL_PATTERNS = {
    "c++": re.compile(
        r"__global__\s+(?:(?:void|static|inline|__launch_bounds__\s*\([^)]*\))\s+)*(\w+)\s*(?:<[^>]*>\s*)?\("
    ),
    "ptx": re.compile(r"\.entry\s+([\w$]+)"),
}
_MAX_KERNELS = 256


def _kernels(source: str | bytes, code_type: str) -> tuple[str, ...]:
    pattern = _KERNEL_PATTERNS.get(code_type)
    if pattern is None:
        return ()
    text = source if isinstance(source, str) else bytes(source).decode("utf-8", "replace")
    names = sorted({m.group(1) for m in pattern.finditer(text) if len(m.group(1)) <= MAX_FIELD_CHARS})
    return tuple(names[:_MAX_KERNELS])


def compile_inputs(
    compiled: CompileKey,
    source: str | bytes,
    code_type: str,
    options: Any,
    target_type: str,
    name_expressions: Sequence[str | bytes] = (),
    extra_digest: bytes | None = None,
) -> CompileInputs:
    """What a manifest records of one compile (pure but for the compiler-version probe, memoized)."""
    code_type = code_type.lower()
    data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else bytes(source)
    compiler, version = compiler_of(code_type)
    arch = getattr(options, "arch", None)
    name = getattr(options, "name", None)
    if isinstance(name, str):
        name = name.replace("\\", "/").rsplit("/", 1)[-1]  # its directory is the "source" root, not recorded
    return CompileInputs(
        key_schema=key_schema_version(),
        portable=compiled.portable,
        source_sha256=hashlib.sha256(data, usedforsecurity=False).hexdigest(),
        code_type=code_type,
        target=target_type.lower(),
        arch=str(arch) if arch is not None else None,
        program_name=name if isinstance(name, str) else None,
        options=_without_machine_paths(compiled.options, options),
        compiler=compiler,
        compiler_version=version,
        headers=tuple(HeaderFile(h.root, redacted(h.path), h.digest) if h.root == "abs" else h
                      for h in compiled.headers),
        headers_omitted=0,
        missing=tuple(compiled.missing),
        name_expressions=tuple(name_expressions),
        kernels=_kernels(source, code_type),
        extra_digest_sha256=hashlib.sha256(bytes(extra_digest), usedforsecurity=False).hexdigest()
        if extra_digest is not None else None,
    )  # fmt: skip


def redacted(path: str) -> str:
    """How a machine path stands in a manifest: ``<redacted:sha256:`` + 16 hex digits of it + ``>``."""
    return "<redacted:sha256:" + hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:16] + ">"


def _without_machine_paths(option_strings: Sequence[str], options: Any) -> tuple[str, ...]:
    """The keyed option strings with every absolute path named by its role, or redacted under none.

    A portable key's strings already hold role tokens; a path-keyed one's hold the paths themselves.
    """
    roles = path_roles(options)
    out = []
    for option in option_strings:
        flag, eq, value = option.partition("=")
        if eq and os.path.isabs(value):
            named = role_relative(os.path.normpath(value), roles)
            option = f"{flag}={named if named is not None else redacted(value)}"
        elif not eq and os.path.isabs(option):
            option = redacted(option)
        out.append(option)
    return tuple(out)


def build_manifest(
    key: bytes, inputs: CompileInputs, compile_seconds: float, *, now: Callable[[], float] = time.time
) -> Manifest:
    """The manifest of the entry under ``key``: ``inputs``, the compile time, and this host and time."""
    written = datetime.datetime.fromtimestamp(now(), datetime.timezone.utc).strftime(_TIME_FORMAT)
    return Manifest(
        entry=entry_name(bytes(key)),
        inputs=inputs,
        compile_seconds=float(compile_seconds),
        provenance=Provenance(socket.gethostname(), written, _packages()),
    )


# -- bytes -------------------------------------------------------------------------------------------


def _tagged(value: str | bytes) -> list[str]:
    return ["b", value.decode("latin-1")] if isinstance(value, bytes) else ["s", value]


def _document(m: Manifest) -> dict[str, Any]:
    i, p = m.inputs, m.provenance
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "entry": m.entry,
        "key_schema": i.key_schema,
        "portable": i.portable,
        "source_sha256": i.source_sha256,
        "code_type": i.code_type,
        "target": i.target,
        "arch": i.arch,
        "program_name": i.program_name,
        "options": list(i.options),
        "compiler": {"name": i.compiler, "version": i.compiler_version},
        "headers": [[h.root, h.path, h.digest] for h in i.headers],
        "headers_omitted": i.headers_omitted,
        "missing": list(i.missing),
        "name_expressions": [_tagged(n) for n in i.name_expressions],
        "kernels": list(i.kernels),
        "extra_digest_sha256": i.extra_digest_sha256,
        "compile_seconds": round(m.compile_seconds, 6),
        "written_by": {"host": p.host, "time": p.written_at, "packages": dict(p.packages)},
    }


def encode_manifest(m: Manifest) -> bytes:
    """The stored bytes of ``m`` (JSON, sorted keys), within :data:`MAX_MANIFEST_BYTES`.

    Over the bound, the header list is left out (and counted in ``headers_omitted``);
    ``ManifestError`` if it is still over (thousands of long options or name expressions).
    """
    data = _dump(_document(m))
    if len(data) > MAX_MANIFEST_BYTES and m.inputs.headers:
        lean = dataclasses.replace(
            m.inputs, headers=(), headers_omitted=m.inputs.headers_omitted + len(m.inputs.headers)
        )
        data = _dump(_document(dataclasses.replace(m, inputs=lean)))
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte bound")
    return data


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


_KEYS = frozenset({
    "format", "version", "entry", "key_schema", "portable", "source_sha256", "code_type", "target", "arch",
    "program_name", "options", "compiler", "headers", "headers_omitted", "missing", "name_expressions",
    "kernels", "extra_digest_sha256", "compile_seconds", "written_by",
})  # fmt: skip


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise ManifestError("a key appears twice")
    return doc


def _no_constant(name: str) -> Any:
    raise ManifestError(f"{name} is not a number a manifest holds")


def decode_manifest(data: bytes | None, *, entry: str | None = None) -> Manifest:
    """The manifest in ``data``, checked field by field; ``ManifestError`` saying what is wrong.

    ``entry``: the entry name it must describe (a manifest stored beside another
    entry's binary is refused). Nothing in it is evaluated; unknown or missing fields,
    another format or version, wrong types, over-long strings and documents over
    :data:`MAX_MANIFEST_BYTES` are all refused.
    """
    return _decode(data, entry, build_headers=True)


def compile_seconds_of(data: bytes | None, *, entry: str | None = None) -> float:
    """``decode_manifest(data, entry=entry).compile_seconds``: every check made, the header files not built.

    What a cache hit reads for the saved-seconds tally (a CUB kernel's manifest lists 610 headers).
    """
    return _decode(data, entry, build_headers=False).compile_seconds


def _decode(data: bytes | None, entry: str | None, *, build_headers: bool) -> Manifest:
    if data is None:
        raise ManifestError("no manifest")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"a manifest is bytes, got {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte bound")
    try:
        raw = bytes(data)  # as json.loads(bytes) reads it, through one decoder made once (not one per call)
        doc = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except ManifestError:
        raise
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"not a JSON object but {type(doc).__name__}")
    if doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"format {_short(doc.get('format'))}, not {MANIFEST_FORMAT!r}")
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"version {_short(doc.get('version'))}, this reader knows {MANIFEST_VERSION}")
    if set(doc) != _KEYS:
        extra, absent = sorted(set(doc) - _KEYS), sorted(_KEYS - set(doc))
        raise ManifestError(f"fields differ from version {MANIFEST_VERSION}'s: unknown {extra}, missing {absent}")
    try:
        manifest = _from_document(doc, build_headers=build_headers)
    except (TypeError, ValueError, KeyError) as exc:
        raise ManifestError(str(exc) if isinstance(exc, ManifestError) else f"bad field: {exc}") from None
    if entry is not None and manifest.entry != entry:
        raise ManifestError(f"describes entry {manifest.entry[:12]}, not {entry[:12]}")
    return manifest


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constant)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _str(value: Any, field: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ManifestError(f"{field} must be a string, got {type(value).__name__}")
    if len(value) > MAX_FIELD_CHARS:
        raise ManifestError(f"{field} is over {MAX_FIELD_CHARS} characters")
    return value


def _hex64(value: Any, field: str, *, optional: bool = False) -> Any:
    value = _str(value, field, optional=optional)
    if value is not None and not _HEX64.fullmatch(value):
        raise ManifestError(f"{field} must be 64 lowercase hex digits")
    return value


def _strs(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ManifestError(f"{field} must be a list, got {type(value).__name__}")
    return tuple(_str(v, f"{field} item") for v in value)


def _int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"{field} must be a non-negative integer, got {_short(value)}")
    return value


_STR, _LIST = frozenset({str}), frozenset({list})
_NOT_HEX = str.maketrans("", "", "0123456789abcdef")  # deletes hex digits: what is left is not hex


def _header_files(items: list[Any], *, build: bool = True) -> list[HeaderFile]:
    """``[root, path, digest]`` items as HeaderFiles: checked by columns (a CUB kernel lists 600
    and more), and item by item, for the message naming the first bad one, when that check fails.
    ``build`` False: checked only, none built (an empty list)."""
    if _LIST.issuperset(map(type, items)) and set(map(len, items)) <= {3}:
        roots, paths, digests = zip(*items) if items else ((), (), ())
        if (_STR.issuperset(map(type, roots)) and _STR.issuperset(map(type, paths))
                and _STR.issuperset(map(type, digests))
                and max(map(len, roots), default=0) <= MAX_FIELD_CHARS
                and max(map(len, paths), default=0) <= MAX_FIELD_CHARS
                and set(map(len, digests)) <= {64} and not "".join(digests).translate(_NOT_HEX)):
            return list(map(HeaderFile, roots, paths, digests)) if build else []
    headers = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3):
            raise ManifestError("a header must be [root, path, digest]")
        headers.append(HeaderFile(_str(item[0], "header root"), _str(item[1], "header path"), _hex64(item[2], "header digest")))
    return headers


def _from_document(doc: dict[str, Any], *, build_headers: bool = True) -> Manifest:
    entry = _str(doc["entry"], "entry")
    if not is_entry_name(entry):
        raise ManifestError("entry is not an entry name")
    if not isinstance(doc["portable"], bool):
        raise ManifestError("portable must be true or false")
    compiler = doc["compiler"]
    if not isinstance(compiler, dict) or set(compiler) != {"name", "version"}:
        raise ManifestError("compiler must be {name, version}")
    if not isinstance(doc["headers"], list):
        raise ManifestError("headers must be a list")
    headers = _header_files(doc["headers"], build=build_headers)
    names: list[str | bytes] = []
    if not isinstance(doc["name_expressions"], list):
        raise ManifestError("name_expressions must be a list")
    for item in doc["name_expressions"]:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in ("s", "b")):
            raise ManifestError("a name expression must be ['s' or 'b', text]")
        text = _str(item[1], "name expression")
        names.append(text if item[0] == "s" else text.encode("latin-1"))
    seconds = doc["compile_seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 <= seconds < math.inf):
        raise ManifestError(f"compile_seconds must be a non-negative number, got {_short(seconds)}")
    written = doc["written_by"]
    if not isinstance(written, dict) or set(written) != {"host", "time", "packages"}:
        raise ManifestError("written_by must be {host, time, packages}")
    when = _str(written["time"], "written_by.time")
    stamp = _TIME_PATTERN.fullmatch(when)
    if stamp is None:
        raise ValueError(f"written_by.time is not {_TIME_FORMAT}")
    datetime.datetime(*map(int, stamp.groups()))  # ValueError (a 13th month, a 30th of February): refused
    packages = written["packages"]
    if not isinstance(packages, dict) or len(packages) > 16:
        raise ManifestError("written_by.packages must be an object of at most 16 names")
    inputs = CompileInputs(
        key_schema=_int(doc["key_schema"], "key_schema"),
        portable=doc["portable"],
        source_sha256=_hex64(doc["source_sha256"], "source_sha256"),
        code_type=_str(doc["code_type"], "code_type"),
        target=_str(doc["target"], "target"),
        arch=_str(doc["arch"], "arch", optional=True),
        program_name=_str(doc["program_name"], "program_name", optional=True),
        options=_strs(doc["options"], "options"),
        compiler=_str(compiler["name"], "compiler name"),
        compiler_version=_str(compiler["version"], "compiler version"),
        headers=tuple(headers),
        headers_omitted=_int(doc["headers_omitted"], "headers_omitted"),
        missing=_strs(doc["missing"], "missing"),
        name_expressions=tuple(names),
        kernels=_strs(doc["kernels"], "kernels"),
        extra_digest_sha256=_hex64(doc["extra_digest_sha256"], "extra_digest_sha256", optional=True),
    )
    provenance = Provenance(
        host=_str(written["host"], "written_by.host"),
        written_at=when,
        packages=tuple(sorted((_str(k, "package"), _str(v, "package version")) for k, v in packages.items())),
    )
    return Manifest(entry=entry, inputs=inputs, compile_seconds=float(seconds), provenance=provenance)


# -- reading them back from a listing ------------------------------------------------------------------


def read_manifests(store: EntryStore, listed: Iterable[StoredEntry]) -> dict[str, Manifest | str]:
    """The manifest of each listed entry that has one beside it: entry name -> manifest, or why it is unreadable.

    From one listing (``listed``): an entry's manifest is read only if the listing holds
    it, and only if its listed size fits an envelope of :data:`MAX_MANIFEST_BYTES` (a
    larger one is reported, not read). Reads go in the store's batches. Entries with no
    manifest are left out; a manifest is never listed as an entry with one.
    """
    by_name = {e.name: e for e in listed}
    wanted: dict[str, str] = {}  # manifest name -> entry name
    for name in by_name:
        m = manifest_name(name)
        if m in by_name and m not in wanted:
            wanted[m] = name
    wanted = {m: name for m, name in wanted.items() if name not in wanted}  # a manifest's own manifest: none
    out: dict[str, Manifest | str] = {}
    bound = max_stored_bytes(MAX_MANIFEST_BYTES)
    to_read = []
    for m, name in wanted.items():
        if by_name[m].size > bound:
            out[name] = f"unreadable manifest: {by_name[m].size} bytes, over the {MAX_MANIFEST_BYTES}-byte bound"
        else:
            to_read.append(m)
    out.update(_read_batches(store, to_read, wanted, absent_ok=False))
    return out


def _read_batches(
    store: EntryStore, to_read: list[str], wanted: Mapping[str, str], *, absent_ok: bool
) -> dict[str, Manifest | str]:
    """Manifests ``to_read``, in the store's batches: entry name (``wanted[m]``) -> manifest, or why it is unreadable.

    ``absent_ok``: a manifest the store does not have is left out (else it is reported).
    """
    out: dict[str, Manifest | str] = {}
    for chunk, got in read_in_batches(store, to_read):
        for m in chunk:
            name = wanted[m]
            if absent_ok and m in got.missing:
                continue  # no manifest there either (stored by Program.compile(cache=...))
            result = got.hits.get(m)
            if result is None:
                error = got.errors.get(m)
                out[name] = f"unreadable manifest: {'gone since listed' if error is None else one_line(error)}"
                continue
            try:
                out[name] = decode_manifest(result, entry=name)
            except ManifestError as exc:
                out[name] = f"unreadable manifest: {exc}"
    return out


def manifest_columns(
    store: EntryStore, listed: Sequence[StoredEntry], *, shared: Callable[[], EntryStore | None] | None = None
) -> dict[str, tuple[str, str, str, str]]:
    """Per listed entry, what ``ls --long`` shows from its manifest: (host, written, compile seconds, kind).

    ``"-"`` where an entry has no manifest; a manifest itself shows kind ``manifest``;
    an unreadable one ``?`` and kind ``unreadable-manifest``. Reads as :func:`read_manifests`,
    then, where entries lack a manifest beside them and ``shared`` gives a shared store
    (called then only), reads theirs from it (:func:`read_shared_manifests`).
    Every entry of a store of Triton's files (``namespace`` ``triton``) is kind ``triton``, unread.
    """
    if store.namespace == "triton":
        return {e.name: ("-", "-", "-", "triton") for e in listed}
    found = read_manifests(store, listed)
    names = {e.name for e in listed}
    if shared is not None:
        found.update(read_shared_manifests(shared, listed, found))
    manifests = {manifest_name(name) for name in found}
    out: dict[str, tuple[str, str, str, str]] = {}
    for e in listed:
        m = found.get(e.name)
        if isinstance(m, Manifest):
            kind = f"{m.inputs.code_type}->{m.inputs.target}"
            out[e.name] = (m.provenance.host, m.provenance.written_at, f"{m.compile_seconds:.3f}s", kind)
        elif isinstance(m, str):
            out[e.name] = ("?", "?", "?", "unreadable-manifest")
        elif e.name in manifests and e.name in names:
            out[e.name] = ("-", "-", "-", "manifest")
        else:
            out[e.name] = ("-", "-", "-", "-")
    return out


def read_shared_manifests(
    shared: Callable[[], EntryStore | None], listed: Iterable[StoredEntry], found: Mapping[str, object]
) -> dict[str, Manifest | str]:
    """Manifests of listed entries that have none beside them, read from the shared store ``shared()`` gives.

    A hit promoted from the remote brings the binary alone; ``compile()`` wrote its
    manifest to the remote. Entries that are manifests themselves, or already in
    ``found``, are not asked for. One read per entry asked for, in the store's batches;
    a manifest absent there too is left out; a shared store that cannot be reached is a
    warning and leaves them all out (``ls`` still lists).
    """
    by_name = {e.name: e for e in listed}
    own = {manifest_name(name) for name in by_name if manifest_name(name) in by_name}
    wanted = {manifest_name(name): name for name in by_name if name not in found and name not in own
              and manifest_name(name) not in by_name}  # fmt: skip
    out: dict[str, Manifest | str] = {}
    if not wanted:
        return out
    try:
        store = shared()
        if store is None:
            return out
        out.update(_read_batches(store, list(wanted), wanted, absent_ok=True))
    except Exception as exc:
        logger.warning("could not read manifests from the shared store: %s", one_line(exc))
    return out
