"""Direct mode: a node finds a header-heavy compile's key in a shared manifest by hashing, never scanning.

ccache's direct mode, shared through the tiers. A *direct manifest* is stored under a key
made of everything that keys the compile except the header digest (:func:`direct_key`:
cuda-core's key over the keyed options, with a direct-mode digest in place of the header
digest). It holds up to :data:`MAX_SETS` *header sets*, newest first, each what one scan
of that compile depended on and what it found: every path it probed (by the root it lies
under and the path relative to it), with the content digest of each file found and the
absence of each probe that found nothing; where each directory resolved to; how the roots
lie relative to each other; and the header digest, the entry key and the files the key
covers. A lookup fetches the manifest once, takes the newest set that holds on this node
(stats, realpaths, and hashes of the files it names, through the stat-validated digest
memo; no lexing) and keys the compile with its header digest: the very key a scan would
give, so nodes in direct mode and nodes that scan share entries. Anything else (no
manifest, no set that holds, a manifest that is corrupt, forged or over
:data:`MAX_MANIFEST_BYTES`, a key that does not come out as recorded) runs the header scan.

Why a set that holds gives the scan's key: the scan is a function of the source, the
options (both in the direct key) and what its probes see; every probe is built by joining
a root (include directory, source directory, working directory, or a real directory the
scan recorded) with a spelling taken from the source or a header, so with the same root
layout, the same contents and absences at the same relative places and the same
realpaths, the scan on this node would probe the same places, read the same bytes and
digest the same stream. Scans for which that argument does not hold record no set (an
absolute ``#include`` spelled in a file, a ``..`` read textually across a symlink, a PCH
file, a directory walk, a declined scan); a compile keyed by location (``portable_keys``
off, debug information, a file under no root) records its roots' absolute paths, and its
set holds only where they are the same.

Bounds: :data:`MAX_SETS` sets and :data:`MAX_MANIFEST_BYTES` stored bytes (zlib-compressed
JSON; a CUB BlockReduce set is about 30 KB), the oldest dropped first; a set that alone
is over the byte bound is not recorded. Recording is read-modify-write through the chain
(signed by the envelope where a key is set): writers racing lose a set at worst, which
costs the next node one scan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import types
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Union

import cachetools
from cuda.core import ProgramOptions
from cuda.core.utils import make_program_cache_key

from ..chain.stats import MetadataKey
from ..stores.kinds import DIRECT_MAGIC
from . import keys
from .headermemo import HeaderFile, ScanResult, is_racy, resolve, signature, signature_of_stat
from .headerlex import ANGLE, DEFINE, HAS_WRAPPER, QUOTE, WRAPS, parse_includes
from .headerscan import MAX_HEADER_BYTES, adopt_scan, file_digest, locate, path_list, scan_view

if TYPE_CHECKING:
    from ..chain.tiered import TieredProgramCache

__all__ = [
    "DIRECT_MAGIC",
    "MAX_MANIFEST_BYTES",
    "MAX_SETS",
    "DirectCounts",
    "Unscanned",
    "DirectManifestError",
    "compile_key",
    "decode_direct",
    "direct_counts",
    "direct_key",
    "encode_direct",
    "header_set",
    "match",
    "prehash",
    "read_sets",
    "record",
    "record_none",
]

logger = logging.getLogger(__name__)

#: One include directory or several, as ``ProgramOptions.include_path`` takes them (``os.PathLike`` too).
IncludePath = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

#: Header sets one manifest keeps, newest first.
MAX_SETS = 8
#: Stored bytes of one manifest, at most; a bigger one is ignored when read.
MAX_MANIFEST_BYTES = 1 << 20
#: Bytes a manifest may inflate to when read (past this it is refused).
MAX_DECODED_BYTES = 16 << 20
_FORMAT = "tiered-progcache/direct"
_MARK = {flag: hashlib.sha256(b"tiered-progcache/direct/1 by-role=%d" % flag).digest() for flag in (0, 1)}
_HEX = frozenset("0123456789abcdef")


class DirectManifestError(ValueError):
    """A stored direct manifest that is not exactly what :func:`encode_direct` writes."""


@dataclasses.dataclass(frozen=True)
class DirectCounts:
    """This process's direct-mode lookups: ``hits`` (a set held), ``misses`` (scanned after asking),
    ``recorded`` (manifests written with a new set), ``refused`` (manifests read that were bad)."""

    hits: int
    misses: int
    recorded: int
    refused: int


#: Direct manifests this process just found absent (storage key): the compile's record then reads none again.
_absent: cachetools.LRUCache[bytes, bool] = cachetools.LRUCache(maxsize=1024)
_counts = {"hits": 0, "misses": 0, "recorded": 0, "refused": 0}
_counts_lock = threading.Lock()


def _count(name: str) -> None:
    with _counts_lock:
        _counts[name] += 1


def direct_counts() -> DirectCounts:
    """Direct-mode lookups so far in this process (tests and benchmarks prove a path with them)."""
    return DirectCounts(**_counts)


def direct_key(
    source: str | bytes, code_type: str, options: ProgramOptions, target_type: str,
    name_expressions: Sequence[str | bytes], extra_digest: bytes | None, by_role: bool,
) -> bytes:
    """The cache key a compile's direct manifest is stored under: its key with no header digest (pure).

    A :class:`~tiered_progcache.chain.stats.MetadataKey`: reading it counts no lookup, as a symbol map's read does.
    """
    key = make_program_cache_key(
        code=source, code_type=code_type, options=keys.keyed_options(options, by_role), target_type=target_type,
        name_expressions=name_expressions, extra_digest=keys.combine_digests(extra_digest, _MARK[by_role]),
    )
    return MetadataKey(hashlib.sha256(b"tiered-progcache/direct#" + key, usedforsecurity=False).digest())


# -- roots and where paths lie ------------------------------------------------------------------


def _spelled_roots(options: Any, cwd: str) -> tuple[str, ...]:
    """The include directories, the source's directory (unless ``no_source_include``) and the working
    directory, absolute as the scanner makes them (``headerscan.path_roles``) in working directory ``cwd``."""
    roots = [os.path.normpath(os.path.join(cwd, d)) for d in path_list(getattr(options, "include_path", None))]
    if not getattr(options, "no_source_include", False):
        name = getattr(options, "name", None)
        if isinstance(name, str) and ("/" in name or "\\" in name):
            roots.append(os.path.normpath(os.path.join(cwd, os.path.dirname(name))))
        else:
            roots.append(cwd)
    roots.append(cwd)
    return tuple(roots)


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` if it lies under it textually ('' for the root itself), else None."""
    if path == root:
        return ""
    prefix = root if root.endswith("/") else root + "/"
    return path[len(prefix):] if path.startswith(prefix) else None


def _canon(path: str, roots: Sequence[str]) -> tuple[int, str]:
    """``(root index, relative path)`` by the first root ``path`` lies under; ``(-1, path)`` under none."""
    for i, root in enumerate(roots):
        rel = _under(path, root)
        if rel is not None:
            return i, rel
    return -1, path


#: Row indices that name a path by how the scanner made it, not by a root: the normpath of a ``..``
#: candidate (its candidate ``"index\0rel"`` as rel), the dirname of one, and a realpath under no root that
#: is the directory's normpath.
_TEXTUAL, _TEXTUAL_DIR, _ITSELF = -3, -4, -5
#: A realpath under no root named by the roots it is an ancestor of, and how far up: ``"k:depth,..."``.
_ANCESTOR = -6


def _include_roots(roots: Sequence[str], options: Any) -> list[int]:
    """The indices of the include directories among ``roots``, as spelled and as resolved."""
    n = len(path_list(getattr(options, "include_path", None)))
    half = len(roots) // 2
    return [*range(n), *range(half, half + n)]


def _mask(path: str, roots: Sequence[str], keep: int = -1) -> int:
    """Which roots ``path`` lies under (textually, itself included), of those in ``keep``: one bit per root,
    a root as spelled and as resolved folded into one bit. A host that reaches a root through a symbolic
    link (``/usr/local/cuda/include/cccl``) and one where it is a plain directory (a copy) then agree; where
    spelling and resolution lead apart, the set's ``real`` rows check each directory's realpath."""
    mask = 0
    for i, root in enumerate(roots):
        if path == root or path.startswith(root if root.endswith("/") else root + "/"):
            mask |= 1 << i
    mask &= keep
    half = len(roots) // 2
    low = (1 << half) - 1
    return (mask | (mask >> half)) & low


def _file_masks(roots: Sequence[str], keep: int) -> Callable[[str], int]:
    """:func:`_mask` of files, computed once per directory (a few dozen hold a CCCL kernel's ~700 headers):
    a file lies under a root exactly when its directory, with a trailing slash, does. (A file that were a
    root itself would get a mask without that root's bit: its row then does not hold, and the node scans.)"""
    by_directory: dict[str, int] = {}

    def mask_of(path: str) -> int:
        directory = path.rpartition("/")[0]
        mask = by_directory.get(directory)
        if mask is None:
            mask = by_directory[directory] = _mask(directory + "/", roots, keep)
        return mask

    return mask_of


def _mask_keep(source: str | bytes, options: Any, roots: Sequence[str], eligible: Sequence[int]) -> int:
    """The roots whose bits a set's masks compare: all of them, unless nothing the scanner reads from the
    source's directory or the working directory can lead into an include directory (no computed include in
    the source; no quoted include of the source, no relative ``pre_include``, that lands under one there;
    the caller also keeps them all where a header was found there):
    then only the include directories, so a checkout holding its venv and a node whose venv lies
    elsewhere share a set."""
    data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else bytes(source)
    parsed = parse_includes(data)
    if any(kind not in (QUOTE, ANGLE, DEFINE, WRAPS, HAS_WRAPPER) for kind, _ in parsed):
        return -1
    half = len(roots) // 2
    bases = [roots[half - 1], roots[-1]]  # the working directory, as spelled and resolved
    if not getattr(options, "no_source_include", False):
        bases += [roots[half - 2], roots[-2]]  # the source's directory
    spellings = [sp for kind, sp in parsed if kind == QUOTE and not os.path.isabs(sp)]
    spellings += [sp for sp in path_list(getattr(options, "pre_include", None)) if not os.path.isabs(sp)]
    include_bits = sum(1 << i for i in eligible)
    for base in bases:
        for spelling in spellings:
            for path in {os.path.join(base, spelling), os.path.normpath(os.path.join(base, spelling))}:
                if _mask(path, roots, include_bits):
                    return -1
    return include_bits


def _ancestry(path: str, roots: Sequence[str], eligible: Sequence[int]) -> str:
    """``"k:depth,..."`` for every include root ``k`` that ``path`` is a proper ancestor of ('' for none), a
    root as spelled and as resolved named by one ``k`` (as :func:`_mask` folds them)."""
    half = len(roots) // 2
    out = set()
    for k in eligible:
        rel = _under(roots[k], path)
        if rel:
            out.add((k % half, rel.count("/") + 1))
    return ",".join(f"{k}:{depth}" for k, depth in sorted(out))


def _place_ancestor(rel: str, roots: Sequence[str], eligible: Sequence[int], resolved: str) -> str | None:
    """The directory :func:`_ancestry` named, on this node, if it is ``resolved`` (a directory's realpath)
    and an ancestor of exactly those roots, counted up from the root as spelled or as resolved (which
    roots it lies under is the row's mask's to check)."""
    first = rel.partition(",")[0]
    k, _, depth = first.partition(":")
    half = len(roots) // 2
    if not (k.isdigit() and depth.isdigit() and int(k) < half and 0 < int(depth) < 4096):
        return None
    for base in (roots[int(k)], roots[int(k) + half]):
        path = base
        for _ in range(int(depth)):
            path = os.path.dirname(path)
        if path == resolved and _ancestry(path, roots, eligible) == rel:
            return path
    return None


def _canon_made(path: str, roots: Sequence[str], textual: dict[str, str], textual_dirs: dict[str, str],
                prefer_made: bool = False) -> tuple[int, str]:
    """:func:`_canon`, but a path under no root (any path, with ``prefer_made``) that is the normpath of
    a ``..`` candidate (or its directory) is named by that candidate, as the scanner made it."""
    index, rel = _canon(path, roots)
    if index >= 0 and not prefer_made:
        return index, rel
    for kind, made in ((_TEXTUAL, textual), (_TEXTUAL_DIR, textual_dirs)):
        if path in made:
            i, r = _canon(made[path], roots)
            if i >= 0:
                return kind, f"{i}\0{r}"
    return index, rel


def _place_made(index: int, rel: str, roots: Sequence[str]) -> str | None:
    """The path :func:`_canon_made` named, on this node (which roots it lies under is the row's mask's
    to check); None where the row is malformed."""
    if index not in (_TEXTUAL, _TEXTUAL_DIR):
        return _place(index, rel, roots)
    i, _, r = rel.partition("\0")
    if not i.isdigit() or int(i) >= len(roots):
        return None
    path = os.path.normpath(_place(int(i), r, roots))
    if index == _TEXTUAL_DIR:
        path = os.path.dirname(path)
    return path


def _place(index: int, rel: str, roots: Sequence[str]) -> str:
    """The path :func:`_canon` named ``(index, rel)``, on this node."""
    if index < 0:
        return rel
    root = roots[index]
    if not rel:
        return root
    return root + rel if root.endswith("/") else root + "/" + rel


def _place_resolved(index: int, rel: str, roots: Sequence[str], resolved: str) -> str:
    """:func:`_place` of a realpath row: under the root as spelled or as resolved, whichever is ``resolved``
    on this node (a host that reaches the root through a link names it by the resolved root, one where it
    is a plain directory by the spelled one); otherwise the recorded root's, for the caller to refuse."""
    if index >= 0:
        half = len(roots) // 2
        for i in (index % half, index % half + half):
            if _place(i, rel, roots) == resolved:
                return resolved
    return _place(index, rel, roots)


def _itself(directory: str, roots: Sequence[str], eligible: Sequence[int], resolved: str) -> str:
    """The realpath an ``_ITSELF`` row stands for here: the directory's normpath where no link is on the
    way, or its realpath ``resolved`` where that stands to the resolved roots as the normpath does to the
    spelled ones (``/usr/local/cuda`` -> ``cuda-13.0`` above an include root); otherwise the normpath, to be
    refused."""
    norm = os.path.normpath(directory)
    if resolved != norm and _ancestry(norm, roots, eligible) and (
            _ancestry(norm, roots, eligible) == _ancestry(resolved, roots, eligible)):
        return resolved
    return norm


# -- the stored form ----------------------------------------------------------------------------


def encode_direct(sets: Sequence[dict[str, Any]]) -> bytes:
    """The stored form of ``sets`` (newest first, none for a compile no set can be recorded of), less the
    oldest past :data:`MAX_SETS` or :data:`MAX_MANIFEST_BYTES`; raises :class:`DirectManifestError` if not
    even the newest fits."""
    kept = list(sets[:MAX_SETS])
    while True:
        body = json.dumps({"format": _FORMAT, "sets": kept}, separators=(",", ":"), allow_nan=False).encode()
        payload = DIRECT_MAGIC + zlib.compress(body, 6)
        if len(payload) <= MAX_MANIFEST_BYTES and len(body) <= MAX_DECODED_BYTES:
            return payload
        if len(kept) <= 1:
            raise DirectManifestError(f"a header set alone is over {MAX_MANIFEST_BYTES} bytes")
        kept.pop()


def decode_direct(payload: bytes | memoryview) -> list[dict[str, Any]]:
    """The header sets of a stored direct manifest, newest first; :class:`DirectManifestError` unless exact."""
    data = bytes(payload)
    if len(data) > MAX_MANIFEST_BYTES:
        raise DirectManifestError(f"over {MAX_MANIFEST_BYTES} bytes")
    if not data.startswith(DIRECT_MAGIC):
        raise DirectManifestError("not a direct manifest")
    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(data[len(DIRECT_MAGIC):], MAX_DECODED_BYTES)
    except zlib.error as exc:
        raise DirectManifestError(f"not zlib: {exc}") from exc
    if inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
        raise DirectManifestError(f"inflates past {MAX_DECODED_BYTES} bytes, or is cut short or padded")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise DirectManifestError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or set(doc) != {"format", "sets"}:
        raise DirectManifestError("not a direct manifest document")
    sets = doc["sets"]
    if not isinstance(sets, list) or len(sets) > MAX_SETS:
        raise DirectManifestError(f"sets must be a list of at most {MAX_SETS}")
    for one in sets:
        _check_set(one)
    return sets


_SET_FIELDS = {"n", "keep", "at", "files", "absent", "real", "digest", "key", "missing", "path_free"}


def _is_hex(value: object, length: int | None = 64) -> bool:
    return isinstance(value, str) and (length is None or len(value) == length) and bool(value) and _HEX.issuperset(value)


def _rows(value: object, shape: str, n: int) -> bool:
    """Every row a list of the shape's types: ``i`` a root index (or -1), ``T`` one or a made path
    (``_TEXTUAL``...), ``R`` one of those, ``_ITSELF`` or ``_ANCESTOR``, ``m`` a mask of roots, ``s`` a
    str, ``h`` a sha256 hex. Checked a column at a time: a CCCL set has hundreds of rows."""
    if not isinstance(value, list) or not all(isinstance(row, list) and len(row) == len(shape) for row in value):
        return False
    masks = 1 << n
    for column, kind in zip(zip(*value), shape):
        if kind == "s":
            ok = all(isinstance(item, str) for item in column)
        elif kind == "h":
            ok = all(isinstance(item, str) and len(item) == 64 and _HEX.issuperset(item) for item in column)
        elif kind == "m":
            ok = all(type(item) is int and 0 <= item < masks for item in column)
        else:
            low = _LOWEST_INDEX[kind]
            ok = all(type(item) is int and low <= item < n for item in column)
        if not ok:
            return False
    return True


#: The lowest value of each kind of root index in a row (:func:`_rows`).
_LOWEST_INDEX = {"i": -1, "T": _TEXTUAL_DIR, "R": _ANCESTOR}


def _check_set(one: object) -> None:
    if not isinstance(one, dict) or set(one) != _SET_FIELDS:
        raise DirectManifestError("a header set has other fields than a direct manifest's")
    n = one["n"]
    ok = (
        type(n) is int and 0 < n <= 64
        and type(one["keep"]) is int and -1 <= one["keep"] < 1 << n
        and (one["at"] is None or (isinstance(one["at"], list) and len(one["at"]) == n
                                   and all(isinstance(p, str) for p in one["at"])))
        and _rows(one["files"], "ishm", n) and _rows(one["absent"], "Tsm", n)
        and _rows(one["real"], "TsmRsmss", n)
        and _is_hex(one["digest"]) and _is_hex(one["key"], None)
        and isinstance(one["missing"], list) and all(isinstance(m, str) for m in one["missing"])
        and type(one["path_free"]) is bool
    )
    if not ok:
        raise DirectManifestError("a header set holds a value of the wrong type or range")


# -- recording a set ------------------------------------------------------------------------------


def header_set(compiled: keys.CompileKey, source: str | bytes, options: Any) -> dict[str, Any] | None:
    """The header set a scan-made key records, or None where the scan does not allow one (module docstring)."""
    basis = compiled.basis
    if basis is None or compiled.declined is not None or compiled.header_digest is None:
        return None
    result = basis.result
    if not result.read_anything or result.declined is not None or not result.relocatable:
        return None
    real = dict(result.real_checks)
    spelled = _spelled_roots(options, basis.cwd)
    roots = spelled + tuple(real.get(r) or os.path.realpath(r) for r in spelled)
    files, absent, found = [], [], []
    textual = dict(result.textual)
    textual_dirs = {os.path.dirname(t): p for t, p in reversed(result.textual)}
    eligible = _include_roots(roots, options)
    n_includes = len(eligible) // 2
    real_source = None if getattr(options, "no_source_include", False) else roots[len(roots) // 2 + n_includes]
    keep = _mask_keep(source, options, roots, eligible)
    real_includes = roots[len(roots) // 2:][:n_includes]
    if any(sig is not None and sig[0] == "f" and locate(real.get(os.path.dirname(path), path), real_includes,
                                                        real_source, roots[-1])[0] in ("source", "cwd")
           for path, sig in result.checks):
        keep = -1  # a header read from the source's or the working directory: its includes start there too
    relaxed = keep != -1
    for path, sig in result.checks:
        if sig is None:
            absent.append([*_canon_made(path, roots, textual, textual_dirs, relaxed), _mask(path, roots, keep)])
        elif sig[0] == "f":
            found.append(path)
        else:
            return None  # a directory (a walk), something else, an error: not recorded
    digests = {(role, path): digest for role, path, digest in result.headers}
    places = _covered(found, real, roots, options)
    if places is None or len(set(places)) != len(digests) or not digests.keys() >= set(places):
        return None  # what the scan covers is not exactly what its probes found: not recorded
    for path, place in zip(found, places):
        files.append([*_canon(path, roots), digests[place], _mask(path, roots, keep)])
    real_rows = []
    includers = {os.path.dirname(path) or "." for path in found}
    for d, r in result.real_checks:
        d_row = _canon_made(d, roots, textual, textual_dirs, relaxed)
        real_row = _canon(r, roots)
        if relaxed and d_row[0] in (*eligible, _TEXTUAL_DIR) and real_row[0] >= 0 and _ancestry(r, roots, eligible):
            real_row = (_ANCESTOR, _ancestry(r, roots, eligible))  # above an include root: named so, not by cwd
        elif real_row[0] < 0 and r == os.path.normpath(d):
            real_row = (_ITSELF, "")  # under no root, but where ``..`` as text leads (no symbolic link)
        elif real_row[0] < 0 and _ancestry(r, roots, eligible):
            real_row = (_ANCESTOR, _ancestry(r, roots, eligible))  # under no root, above an include root
        role, rel = ("", "") if d not in includers else locate(r, roots[len(roots) // 2:][:n_includes], real_source,
                                                              roots[-1])  # how the digest names an includer
        row = [*d_row, _mask(d, roots, keep), *real_row, _mask(r, roots, keep),
               role, "" if role == "abs" else rel]
        if row[0] == _TEXTUAL or (row[0] == -1) != (row[3] == -1):
            return None  # a directory under no root that the scanner made otherwise: not recorded
        real_rows.append(row)
    bound = not (basis.by_role and result.path_free)
    return {
        "n": len(roots),
        "keep": keep,
        "at": list(roots) if bound else None,
        "files": files,
        "absent": absent,
        "real": real_rows,
        "digest": compiled.header_digest.hex(),
        "key": compiled.key.hex(),
        "missing": list(result.missing),
        "path_free": bool(result.path_free),
    }


def _covered(found: Sequence[str], real: dict[str, str], roots: Sequence[str], options: Any
             ) -> list[tuple[str, str]] | None:
    """How the scan names each file found (``(role, path)``, as ``HeaderFile``): by the role of the
    real directory it lies in (``headerscan.locate``); None where a directory's realpath is not known."""
    name_of = _namer(real, roots, options)
    out = []
    for path in found:
        place = name_of(path)
        if place is None:
            return None
        out.append(place)
    return out


def _namer(real: dict[str, str], roots: Sequence[str], options: Any) -> Callable[[str], tuple[str, str] | None]:
    """:func:`_covered` of one file, each directory located once (a few dozen hold hundreds of files)."""
    n_includes = len(path_list(getattr(options, "include_path", None)))
    reals = roots[len(roots) // 2:]
    real_source = None if getattr(options, "no_source_include", False) else reals[n_includes]
    located: dict[str, tuple[str, str] | None] = {}  # by the directory as spelled: its role and path there

    def name_of(path: str) -> tuple[str, str] | None:
        head, _, name = path.rpartition("/")
        spelled = head if head and not head.endswith("/") else (os.path.dirname(path) or ".")
        place = located.get(spelled, _UNSEEN)
        if place is _UNSEEN:
            directory = real.get(spelled)
            if directory is None:
                place = None
            else:
                role, rel = locate(directory, reals[:n_includes], real_source, reals[-1])
                place = (role, directory if role == "abs" else rel)
            located[spelled] = place
        if place is None:
            return None
        role, where = place
        if role == "abs":
            return role, os.path.join(where, name)
        return role, f"{where}/{name}" if where else name

    return name_of


_UNSEEN: Any = object()


def record(
    cache: Any, compiled: keys.CompileKey, source: str | bytes, code_type: str, options: ProgramOptions,
    target_type: str, names: Sequence[str | bytes], extra_digest: bytes | None, seconds: float | None = None,
    sets: list[dict[str, Any]] | None = None, *, mark_no_set: bytes | None = None,
) -> bool:
    """Add the header set of ``compiled`` to its direct manifest in ``cache`` (a chain); whether it was stored.

    ``sets``: the manifest's sets as just read (else it is read here). ``seconds``: the compile
    time, for the chain's upload admission. ``mark_no_set``: where no set can be recorded, a direct
    key to store a manifest of no set under (:func:`record_none`). Never raises: a failure costs only the record.
    """
    try:
        basis = compiled.basis
        new = header_set(compiled, source, options)
        if basis is None or new is None:
            if mark_no_set is not None:
                record_none(cache, mark_no_set)
            return False
        storage = direct_key(source, code_type, options, target_type, names, extra_digest, basis.by_role)
        if sets is None:
            with _counts_lock:
                absent = _absent.pop(storage, False)
            sets = [] if absent else (read_sets(cache, storage) or [])
        if new in sets:
            return False
        cache.put(storage, encode_direct([new, *(s for s in sets if s != new)]), compile_seconds=seconds)
    except Exception as exc:  # a bug or a failing tier costs the record, never the compile
        logger.warning("could not record the direct manifest of entry %s: %r", compiled.key[:8].hex(), exc)
        return False
    _count("recorded")
    return True


def record_none(cache: Any, storage: bytes) -> None:
    """Store a manifest of no set under ``storage``: a compile flown by its direct key whose headers no set can
    record (an absolute include, a declined scan), so that the next caller scans at once. Never raises."""
    try:
        cache.put(storage, encode_direct([]))
    except Exception as exc:
        logger.warning("could not mark the direct manifest %s: %r", storage[:8].hex(), exc)


def read_sets(cache: Any, storage: bytes) -> list[dict[str, Any]] | None:
    """The sets stored under ``storage``; None where there is no manifest, [] where it is bad (counted)."""
    payload = cache.get(storage)
    if payload is None:
        return None
    try:
        return decode_direct(payload)
    except DirectManifestError as exc:
        _count("refused")
        logger.info("ignoring the direct manifest %s: %s", storage[:8].hex(), exc)
        return []


# -- looking one up ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unscanned:
    """A compile no node recorded a header set for, whose scan read past its bound: ``compile()`` flies it by
    ``storage`` (its direct key), the key its entry will have coming from the scan beside the compile."""

    storage: bytes
    by_role: bool
    cwd: str
    memo_dir: str | os.PathLike[str] | None


def compile_key(
    cache: TieredProgramCache,
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
    defer_past_files: int | None = None,
) -> keys.CompileKey | Unscanned:
    """:func:`.keys.compile_key`, asking ``cache``'s direct manifest before scanning.

    A header-scan memo of this process or of ``memo_dir`` answers first; where none does,
    the direct manifest is read once (the newest set's entry read ahead, beside the hashing)
    and its newest set that holds here gives the key
    (the scan's, byte for byte), the verified set then memoized as a scan (in ``memo_dir``
    at exit). Otherwise the scan runs, and its set is recorded where a manifest exists
    (else :func:`record` after the compile makes one). ``defer_past_files``: where there is no
    manifest and the scan reads more files than that, :class:`Unscanned` instead of the rest of it.
    """
    found = keys.compile_key(source, code_type, options, target_type, name_expressions, extra_digest,
                             portable=portable, recheck_s=recheck_s, memo_dir=memo_dir, memo_only=True)
    if found is not None:
        return found
    by_role = keys.keyed_by_role(options, code_type, portable)
    cwd = os.getcwd()
    sets = storage = None
    absent = False
    try:
        storage = direct_key(source, code_type, options, target_type, name_expressions, extra_digest, by_role)
        shared = cache.shared_store
        # A fresh node's first request, as a rule: beside the store's probe, not after it (a round trip sooner).
        with contextlib.nullcontext() if shared is None else shared.beside_probe():
            sets = read_sets(cache, storage)
        if sets is None:
            absent = True
            with _counts_lock:
                _absent[storage] = True
        elif sets and len(sets[0]["key"]) == 64:  # the newest set's entry, read while its headers are hashed
            cache.read_ahead(bytes.fromhex(sets[0]["key"]))
        hit = match(sets or (), source, code_type, options, target_type, name_expressions, extra_digest,
                     by_role, cwd, memo_dir=memo_dir)
    except Exception as exc:  # unsure means scan
        logger.debug("direct lookup failed: %r", exc)
        hit = None
    if hit is not None:
        _count("hits")
        return hit
    _count("misses")
    bound = defer_past_files if absent else None
    compiled = keys.compile_key(source, code_type, options, target_type, name_expressions, extra_digest,
                                portable=portable, recheck_s=recheck_s, memo_dir=memo_dir, max_files=bound)
    if compiled is None:  # past the bound: a long compile nobody recorded, flown by this key
        assert storage is not None
        return Unscanned(storage, by_role, cwd, memo_dir)
    if absent and compiled.basis is not None:  # a key a set could have been recorded for: none was
        return dataclasses.replace(compiled, unrecorded=True)
    if sets is not None and compiled.basis is not None:
        # A manifest that lacks this set: add it now (the entry may be there already: a hit records
        # nothing else). Where there is no manifest at all, the compile's record makes one, with its
        # compile time for the chain's upload admission.
        record(cache, compiled, source, code_type, options, target_type, name_expressions, extra_digest, sets=sets)
    return compiled


def match(
    sets: Sequence[dict[str, Any]], source: str | bytes, code_type: str, options: ProgramOptions, target_type: str,
    name_expressions: Sequence[str | bytes], extra_digest: bytes | None, by_role: bool, cwd: str,
    *, adopt: bool = True, memo_dir: str | os.PathLike[str] | None = None,
) -> keys.CompileKey | None:
    """The key of the newest set of ``sets`` that holds on this node, or None. ``adopt``: memoize
    the verified set as a scan would be (in this process, and in ``memo_dir`` at exit)."""
    if not sets:
        return None
    spelled = _spelled_roots(options, cwd)
    roots = spelled + tuple(os.path.realpath(r) for r in spelled)
    for one in sets:
        if one["n"] != len(roots):
            continue
        if one["at"] is not None and tuple(one["at"]) != roots:
            continue
        result = _holds(one, roots, options)
        if result is None:
            continue
        scan = scan_view(result, options, code_type, by_role)
        compiled = keys.key_for(source, code_type, options, target_type, name_expressions, extra_digest, scan,
                                by_role, cwd)
        if compiled.key.hex() != one["key"]:
            logger.info("a direct manifest's set keys as %s, recorded as %s: scanning", compiled.key[:8].hex(),
                        one["key"][:16])
            continue
        if adopt and not any(is_racy(sig) for _, sig in result.checks):
            adopt_scan(source, options, by_role, result, memo_dir)  # the next call is a warm memo's, as after a scan
        return compiled
    return None


def prehash(manifests: Sequence[bytes], include_path: IncludePath) -> int:
    """Hash the files the header sets of ``manifests`` (direct manifests' payloads) name under ``include_path``
    (one directory or several, as ``ProgramOptions.include_path``) and this working directory, into the stat-validated digest memo (``warm(include_path=...)``); how many.

    Nothing is trusted from it: a first hit still stats every file and checks every digest, it only finds
    them memoized. A set laid out for other roots, a file that is not there or one over the bound is skipped.
    """
    cwd = os.getcwd()
    spelled = _spelled_roots(types.SimpleNamespace(include_path=include_path), cwd)
    roots = spelled + tuple(os.path.realpath(r) for r in spelled)
    hashed: set[str] = set()
    for payload in manifests:
        try:
            sets = decode_direct(payload)
        except DirectManifestError:
            continue  # (a hit refuses it too, and counts it)
        for one in sets:
            if one["n"] != len(roots):
                continue
            for index, rel, _, _ in one["files"]:
                path = _place(index, rel, roots)
                if path in hashed:
                    continue
                try:
                    sig = signature_of_stat(os.stat(path))
                except OSError:
                    continue
                if sig[0] == "f" and sig[2] <= MAX_HEADER_BYTES and file_digest(path, sig) is not None:
                    hashed.add(path)
    return len(hashed)


def _holds(one: dict[str, Any], roots: Sequence[str], options: Any) -> ScanResult | None:
    """The scan result a set stands for on this node if everything it names is as recorded, else None."""
    checks: list[tuple[str, Any]] = []
    eligible = _include_roots(roots, options)
    n_includes = len(eligible) // 2
    real_source = None if getattr(options, "no_source_include", False) else roots[len(roots) // 2 + n_includes]
    keep = one["keep"]
    made: list[tuple[str, str]] = []  # (normpath, candidate) of each ``..`` candidate, as the scan records them

    def note(index: int, rel: str) -> None:
        if index in (_TEXTUAL, _TEXTUAL_DIR):
            i, _, r = rel.partition("\0")
            candidate = _place(int(i), r, roots)
            made.append((os.path.normpath(candidate), candidate))

    for index, rel, mask in one["absent"]:
        path = _place_made(index, rel, roots)
        if path is None or _mask(path, roots, keep) != mask:
            return None
        note(index, rel)
        if signature(path) is not None:
            return None
        checks.append((path, None))
    real_checks = []
    real_of: dict[str, str] = {"/": "/"}  # the real path of each directory resolve() met
    for index, rel, mask, real_index, real_rel, real_mask, role, role_rel in one["real"]:
        directory = _place_made(index, rel, roots)
        if directory is None or _mask(directory, roots, keep) != mask:
            return None
        note(index, rel)
        resolved = resolve(directory, real_of)
        if real_index == _ANCESTOR:
            real = _place_ancestor(real_rel, roots, eligible, resolved)
        else:
            real = (_itself(directory, roots, eligible, resolved) if real_index == _ITSELF
                    else _place_resolved(real_index, real_rel, roots, resolved))
        if real is None or _mask(real, roots, keep) != real_mask or resolved != real:
            return None
        found_role, found_rel = locate(real, roots[len(roots) // 2:][:n_includes], real_source, roots[-1])
        if role and (found_role, "" if found_role == "abs" else found_rel) != (role, role_rel):
            return None  # the scan would name its files otherwise here
        real_checks.append((directory, real))
    covered = {}
    mask_of = _file_masks(roots, keep)
    name_of = _namer(dict(real_checks), roots, options)
    stat_ = os.stat
    for index, rel, digest, mask in one["files"]:
        path = _place(index, rel, roots)
        if mask_of(path) != mask:
            return None
        try:
            sig = signature_of_stat(stat_(path))
        except OSError:
            return None
        if sig[0] != "f" or sig[2] > MAX_HEADER_BYTES:
            return None
        found = file_digest(path, sig)
        if found is None or found.hex() != digest:
            return None
        place = name_of(path)
        if place is None:
            return None
        checks.append((path, sig))
        covered[place] = digest
    headers = tuple(sorted(HeaderFile(role, path, digest) for (role, path), digest in covered.items()))
    return ScanResult(bytes.fromhex(one["digest"]), True, tuple(checks), tuple(real_checks), time.monotonic(),
                      headers, tuple(one["missing"]), one["path_free"], None, True, tuple(sorted(set(made))))
