"""Why did this compile miss? ``explain()`` compares its key's parts with the manifests stored beside entries.

:func:`explain` takes :func:`tiered_progcache.compiling.compile`'s arguments and answers without
compiling or writing anything: a hit and the tier that holds it, or a miss with the
nearest stored entries (same source first, else the same kernels or name expressions)
and exactly which recorded components differ, as data (:class:`Difference`) and as
lines (``NVRTC 13.0 vs 13.3``, ``header `x.h` content differs``). Every "A vs B" reads
*this compile* vs *the stored entry*.

Cost, at most: per tier, one listing (tiers that cannot be listed by name, the memory
tier, get one lookup of the key instead) and one read of the binary where it is listed
(to tell a usable entry from a rejected one); then on a hit one read of its manifest (where
the tier holding the entry has none, one read in each slower tier until one has it: a
hit promoted from the remote left its manifest there), on
a miss :data:`MAX_MANIFEST_READS` manifest reads in all, newest first, each at most
:data:`~tiered_progcache.compiling.manifest.MAX_MANIFEST_BYTES` (larger listed entries are not read). It walks the tiers fastest first and stops at
the first that holds the entry. A tier that fails is a note in the report, never an
exception. The compile key is computed as ``compile()`` computes it, so headers are
read (and hashed where not memoized).

With ``explain_misses`` on the cache (``TIERED_PROGCACHE_EXPLAIN=1``), ``compile()``
logs :meth:`Explanation.one_line` at INFO for each miss, before compiling (on stderr where
the application set up no logging: :mod:`.visible`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Callable

from cuda.core import ProgramOptions
from cuda.core.utils import ProgramCacheResource

from .compileargs import check_arguments, knob_for
from . import direct
from ..chain.defaultcache import default_cache
from ..stores.envelope import max_stored_bytes
from ..errors import one_line
from .keys import CompileKey, compile_key
from .manifest import (
    MAX_MANIFEST_BYTES,
    CompileInputs,
    Manifest,
    ManifestError,
    compile_inputs,
    decode_manifest,
    manifest_key,
    manifest_name,
)
from ..stores.store import EntryStore, StoredEntry, check_entry_name, entry_name
from .symbols import symbols_key
from ..chain.tiered import TieredProgramCache, as_chain
from ..cluster.flightpolicy import DEFER_PAST_FILES, compile_size
from ..cluster.singleflight import describe, predict

__all__ = [
    "MAX_CANDIDATES",
    "MAX_MANIFEST_READS",
    "Candidate",
    "Difference",
    "Explanation",
    "StoredManifest",
    "Unreadable",
    "differences",
    "explain",
    "explain_key",
    "stored_manifest",
]

logger = logging.getLogger(__name__)

#: Manifests one explanation reads at most (newest first), over every tier.
MAX_MANIFEST_READS = 32
#: Nearest entries one explanation reports.
MAX_CANDIDATES = 3
#: Header differences a report spells out one a line (the data holds them all).
_MAX_HEADER_LINES = 20
#: Differences the one-line form names before "and N more".
_MAX_ONE_LINE = 5


@dataclasses.dataclass(frozen=True)
class Difference:
    """One component that differs between this compile and a stored entry. Immutable.

    ``component``: ``key schema``, ``portable``, ``compiler``, ``code type``, ``target``,
    ``arch``, ``source``, ``program name``, ``option``, ``include root``, ``header``,
    ``missing include``, ``name expressions`` or ``extra digest``. ``subject`` names the
    option, root or header; ``this`` and ``stored`` are the two values (None: absent
    on that side).
    """

    component: str
    subject: str | None
    this: str | None
    stored: str | None

    @property
    def line(self) -> str:
        """The difference for people: ``NVRTC 13.0 vs 13.3``, ``header `a/b.h` only in stored entry``."""
        c, s = self.component, self.subject
        if c == "compiler":
            if self.this is not None and self.stored is not None:
                this_name, _, this_version = self.this.partition(" ")
                stored_name, _, stored_version = self.stored.partition(" ")
                if this_name == stored_name:
                    return f"{this_name} {this_version} vs {stored_version}"
            return f"compiler {self.this} vs {self.stored}"
        if c == "header":
            if self.this is None:
                return f"header `{s}` only in stored entry"
            if self.stored is None:
                return f"header `{s}` only in this compile"
            return f"header `{s}` content differs"
        if c == "include root":
            return f"include root {s} missing" if self.this is None else f"include root {s} only in this compile"
        if c in ("option", "missing include") and (self.this is None or self.stored is None):
            label = "option" if c == "option" else "include found nowhere:"
            side = "only in stored entry" if self.this is None else "only in this compile"
            return f"{label} `{s}` {side}"
        if c == "option":
            return f"option `{s}` {self.this} vs {self.stored}"
        if c in ("source", "extra digest"):
            if self.this is None or self.stored is None:
                return f"{c} only in {'stored entry' if self.this is None else 'this compile'}"
            return f"{c} differs"
        return f"{c} {self.this if self.this is not None else '-'} vs {self.stored if self.stored is not None else '-'}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A stored entry near this compile: which, where, why near, and what differs. Immutable."""

    entry: str
    tier: str
    similarity: str  # "same source", "same kernels", "same name expressions"
    manifest: Manifest
    differences: tuple[Difference, ...]


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A manifest that could not be read or was refused (corrupt, forged, oversize). Immutable."""

    entry: str  # the entry it stands beside
    tier: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Why a compile hits or misses. Immutable; ``lines()`` for people, the fields for code.

    ``entry`` is this compile's entry name and ``inputs`` what its key is made of. On a
    hit, ``tier``/``location`` name the first tier holding it and ``manifest`` is its
    manifest (None when it has none or it is unreadable, then in ``unreadable``). On a
    miss, ``candidates`` are the nearest stored entries, best first (empty: nothing
    similar among ``manifests_read``). ``notes`` say what could not be looked at.
    """

    entry: str
    hit: bool
    tier: str | None
    location: str | None
    manifest: Manifest | None
    inputs: CompileInputs
    candidates: tuple[Candidate, ...]
    unreadable: tuple[Unreadable, ...]
    manifests_read: int
    notes: tuple[str, ...]
    #: The flight case a miss takes in this cache and why, with its predicted ``C`` and the store's ``R``.
    flight: str = ""

    def lines(self) -> tuple[str, ...]:
        out: list[str] = []
        if self.hit:
            out.append(f"hit: entry {self.entry} in tier {self.tier} ({self.location})")
            if self.manifest is not None:
                out.append(_provenance(self.manifest))
            elif not self.unreadable:
                out.append("no manifest beside it (stored by Program.compile(cache=...), or before manifests)")
        else:
            out.append(f"miss: entry {self.entry} is in no tier")
            for c in self.candidates:
                out.append(f"nearest: entry {c.entry} in tier {c.tier} ({c.similarity}); {_provenance(c.manifest)}")
                out += [f"  {line}" for line in _difference_lines(c.differences)]
            if not self.candidates:
                out.append(f"nothing similar stored: none of the {self.manifests_read} manifests read has "
                           "the same source, kernels or name expressions")  # fmt: skip
        out += [f"unreadable manifest beside entry {u.entry} in tier {u.tier}: {u.reason}" for u in self.unreadable]
        out += [f"note: {note}" for note in self.notes]
        if self.flight:
            out.append(f"flight{' (on a miss)' if self.hit else ''}: {self.flight}")
        return tuple(out)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def one_line(self) -> str:
        """The explanation in one log line (what ``compile()`` logs per miss with ``explain_misses``)."""
        head = f"{'hit' if self.hit else 'miss'} {self.entry}"
        if self.hit:
            return f"{head}: held by tier {self.tier}"
        if not self.candidates:
            tail = f"; {len(self.unreadable)} unreadable manifest(s)" if self.unreadable else ""
            return f"{head}: nothing similar stored ({self.manifests_read} manifests read{tail})"
        best = self.candidates[0]
        shown = [d.line for d in best.differences[:_MAX_ONE_LINE]]
        more = len(best.differences) - len(shown)
        diffs = "; ".join(shown) + (f"; and {more} more" if more > 0 else "") if shown else "no recorded component differs"
        return f"{head}: nearest entry {best.entry} (tier {best.tier}, {best.similarity}): {diffs}"


def _provenance(m: Manifest) -> str:
    p, i = m.provenance, m.inputs
    return f"written by {p.host} at {p.written_at}, compiled in {m.compile_seconds:.3f} s by {i.compiler} {i.compiler_version}"


def _difference_lines(differences: Sequence[Difference]) -> list[str]:
    if not differences:
        return ["no recorded component differs (the key also covers what manifests do not record)"]
    lines, headers = [], 0
    for d in differences:
        if d.component == "header":
            headers += 1
            if headers > _MAX_HEADER_LINES:
                continue
        lines.append(d.line)
    if headers > _MAX_HEADER_LINES:
        lines.append(f"and {headers - _MAX_HEADER_LINES} more header differences")
    return lines


# -- comparing two compiles' inputs --------------------------------------------------------------

_ARCH_OPTIONS = frozenset({"-arch", "--gpu-architecture", "arch"})
_INCLUDE_OPTIONS = frozenset({"--include-path", "-I"})


def _split(option: str) -> tuple[str, str | None]:
    name, eq, value = option.partition("=")
    return (name, value) if eq else (option, None)


def _option_groups(options: Sequence[str]) -> dict[str, list[str | None]]:
    groups: dict[str, list[str | None]] = {}
    for option in options:
        name, value = _split(option)
        if name in _ARCH_OPTIONS or name in _INCLUDE_OPTIONS:
            continue  # told as "arch" and "include root"
        groups.setdefault(name, []).append(value)
    return groups


def _roots(inputs: CompileInputs) -> set[str]:
    roots = {h.root for h in inputs.headers if h.root.startswith("I")}
    for option in inputs.options:
        name, value = _split(option)
        if name in _INCLUDE_OPTIONS and value is not None and value[:1] == "I" and value[1:].isdigit():
            roots.add(value)
    return roots


def differences(this: CompileInputs, stored: CompileInputs) -> tuple[Difference, ...]:
    """Every recorded component in which ``stored`` differs from ``this``, in a fixed order (pure)."""
    out: list[Difference] = []

    def differ(component: str, a: Any, b: Any, subject: str | None = None) -> None:
        if a != b:
            out.append(Difference(component, subject, None if a is None else str(a), None if b is None else str(b)))

    differ("key schema", this.key_schema, stored.key_schema)
    differ("portable", this.portable, stored.portable)
    differ("compiler", f"{this.compiler} {this.compiler_version}", f"{stored.compiler} {stored.compiler_version}")
    differ("code type", this.code_type, stored.code_type)
    differ("target", this.target, stored.target)
    differ("arch", this.arch, stored.arch)
    if this.source_sha256 != stored.source_sha256:
        out.append(Difference("source", None, this.source_sha256, stored.source_sha256))
    differ("program name", this.program_name, stored.program_name)

    mine, theirs = _option_groups(this.options), _option_groups(stored.options)
    for name in list(mine) + [n for n in theirs if n not in mine]:
        a, b = mine.get(name, []), theirs.get(name, [])
        if a == b:
            continue
        if len(a) == 1 and len(b) == 1 and a[0] is not None and b[0] is not None:
            out.append(Difference("option", name, a[0], b[0]))
            continue
        for value in [v for v in a if v not in b]:
            out.append(Difference("option", name if value is None else f"{name}={value}", value or "", None))
        for value in [v for v in b if v not in a]:
            out.append(Difference("option", name if value is None else f"{name}={value}", None, value or ""))
        if sorted(a, key=str) == sorted(b, key=str):
            out.append(Difference("option", f"{name} order", " ".join(map(str, a)), " ".join(map(str, b))))

    my_roots, their_roots = _roots(this), _roots(stored)
    for root in sorted(their_roots - my_roots, key=_root_order):
        out.append(Difference("include root", root, None, root))
    for root in sorted(my_roots - their_roots, key=_root_order):
        out.append(Difference("include root", root, root, None))

    if not this.headers_omitted and not stored.headers_omitted:
        mine_h = {(h.root, h.path): h.digest for h in this.headers}
        theirs_h = {(h.root, h.path): h.digest for h in stored.headers}
        for where in sorted(set(mine_h) | set(theirs_h)):
            a, b = mine_h.get(where), theirs_h.get(where)
            if a != b:
                out.append(Difference("header", where[1], a, b))
    for spelling in sorted(set(this.missing) ^ set(stored.missing)):
        present = spelling in this.missing
        out.append(Difference("missing include", spelling, "missing" if present else None,
                              None if present else "missing"))  # fmt: skip
    if this.name_expressions != stored.name_expressions:
        out.append(Difference("name expressions", None, _names(this.name_expressions), _names(stored.name_expressions)))
    if this.extra_digest_sha256 != stored.extra_digest_sha256:
        out.append(Difference("extra digest", None, this.extra_digest_sha256, stored.extra_digest_sha256))
    return tuple(out)


def _root_order(root: str) -> tuple[int, str]:
    return (int(root[1:]), root) if root[1:].isdigit() else (1 << 30, root)


def _names(names: Sequence[str | bytes]) -> str:
    return ", ".join(n if isinstance(n, str) else repr(n) for n in names) or "(none)"


def _similarity(this: CompileInputs, stored: CompileInputs) -> tuple[int, str] | None:
    if this.source_sha256 == stored.source_sha256:
        return 0, "same source"
    if set(this.kernels) & set(stored.kernels):
        return 1, "same kernels"
    if set(this.name_expressions) & set(stored.name_expressions):
        return 1, "same name expressions"
    return None


# -- looking at the tiers -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _View:
    """One tier as explain sees it: by entry name where it can be listed (``store``), else by key (``backend``)."""

    name: str
    location: str
    backend: EntryStore
    store: EntryStore | None

    def held(self, key: bytes) -> bytes | None:
        """The tier's bytes for ``key``, None if absent (uncounted: explain only looks); other failures raise."""
        try:
            return self.backend.read_key(key)
        except KeyError as exc:
            if type(exc) is KeyError:
                return None
            raise


def _views(cache: TieredProgramCache) -> list[_View]:
    """Each tier of the chain, as its :class:`~.tier.Tier` resolved it when it was built."""
    return [_View(t.name, t.location, t.backend, t.entries) for t in cache.tiers]


def explain(
    source: str | bytes,
    code_type: str = "c++",
    options: ProgramOptions | None = None,
    target_type: str = "cubin",
    *,
    cache: ProgramCacheResource | None = None,
    name_expressions: Sequence[str | bytes] = (),
    extra_digest: bytes | None = None,
    portable_keys: bool | None = None,
) -> Explanation:
    """Why ``compile()`` with these arguments would hit or miss, without compiling or writing anything.

    >>> print(tiered_progcache.explain(src, "c++", ProgramOptions(arch="sm_90", std="c++20")))
    miss: entry 3f... is in no tier
    nearest: entry 9a... in tier remote (same source); written by ci-7 at 2026-03-01T10:00:00Z, ...
      option `--std` c++20 vs c++17

    Arguments as for :func:`tiered_progcache.compiling.compile` (checked alike; ``portable_keys``
    left out is the cache's setting, as there). Safe from any thread; reads only (see the
    module's docstring for what it costs).
    """
    names = check_arguments(source, code_type, options, target_type, cache, name_expressions, extra_digest,
                            portable_keys=portable_keys)  # fmt: skip
    if options is None:
        options = ProgramOptions()
    cache = as_chain(default_cache() if cache is None else cache)  # only chains travel inward
    portable_keys = knob_for(cache, "portable_keys", portable_keys)
    compiled = compile_key(source, code_type, options, target_type, names, extra_digest, portable=portable_keys)
    return explain_key(compiled, source, code_type, options, target_type.lower(), cache, names, extra_digest)


def explain_key(
    compiled: CompileKey,
    source: str | bytes,
    code_type: str,
    options: ProgramOptions,
    target: str,
    cache: ProgramCacheResource,
    names: tuple[str | bytes, ...],
    extra_digest: bytes | None,
) -> Explanation:
    """:func:`explain` for a key already computed (``compile()`` calls this on a miss). Never raises for a tier."""
    chain = as_chain(cache)  # a bare resource is a chain of one tier, named as in tiers=[...]
    inputs = compile_inputs(compiled, source, code_type, options, target, names, extra_digest)
    explained = _explained(compiled, inputs, chain, names)
    if compiled.declined is not None:
        return explained
    size = compile_size(len(source), len(compiled.headers))
    flight = describe(chain, predict(chain, code_type, target, size))
    if len(compiled.headers) > DEFER_PAST_FILES and compiled.basis is not None and chain.get(direct.direct_key(
            source, code_type, options, target, names, extra_digest, compiled.basis.by_role)) is None:
        flight = (f"direct key: no node recorded the {len(compiled.headers)} headers it reads "
                  f"(over {DEFER_PAST_FILES}): one compile at a time by its direct key, its scan beside the compile; "
                  f"once recorded, {flight}")
    return dataclasses.replace(explained, flight=flight)


def _explained(
    compiled: CompileKey, inputs: CompileInputs, chain: TieredProgramCache, names: tuple[str | bytes, ...]
) -> Explanation:
    """The hit in the fastest tier that holds a usable entry, else the miss and the nearest stored manifests."""
    key = compiled.key
    name = entry_name(key)
    notes: list[str] = []
    if compiled.declined is not None:
        notes.append(f"not cached, compiled every time: {compiled.declined}")
    listings: list[tuple[_View, dict[str, StoredEntry]]] = []
    views = _views(chain)
    for depth, view in enumerate(views):
        if view.store is None:
            try:
                held = view.held(key) is not None
            except Exception as exc:
                notes.append(f"tier {view.name}: could not look ({one_line(exc)})")
                continue
            if held:
                return _hit(view, key, inputs, None, notes, views[depth + 1 :])
            continue
        try:
            listed = {e.name: e for e in view.store.iter_entries()}
        except Exception as exc:
            notes.append(f"tier {view.name}: could not list it ({one_line(exc)})")
            continue
        if name in listed:
            problem = _unusable(view.store, name, listed, key, names)
            if problem is None:
                return _hit(view, key, inputs, listed, notes, views[depth + 1 :])
            notes.append(f"tier {view.name} holds the entry but it is unusable: {problem}")
        listings.append((view, listed))
    return _miss(name, inputs, listings, notes)


def _unusable(
    store: EntryStore, name: str, listed: dict[str, StoredEntry], key: bytes, names: tuple[str | bytes, ...]
) -> str | None:
    """Why a listed entry would not be returned (it fails its checks, or its symbol map is gone), or None."""
    try:
        problem = store.verify_entry(name)
    except Exception as exc:
        return one_line(exc)
    if problem is not None:
        return problem
    if names and entry_name(symbols_key(key)) not in listed:
        return "its symbol map (for the name expressions) is not stored"
    return None


def _hit(
    view: _View, key: bytes, inputs: CompileInputs, listed: dict[str, StoredEntry] | None, notes: list[str],
    slower: Sequence[_View],
) -> Explanation:
    """The hit in ``view``, with its manifest: beside the entry, else from the first slower tier that holds it.

    A hit promoted from the remote leaves its manifest there (``compile()`` fetches the
    binary only), so the tier holding the entry often lacks it; one read per slower
    tier with an entry store, fastest first, finds it.
    """
    name = entry_name(key)
    unreadable: list[Unreadable] = []
    reads = 0

    def read_in(where: _View, data_of: Any) -> Manifest | None:
        nonlocal reads
        try:
            data = data_of()
            if data is None:
                return None
            reads += 1
            return decode_manifest(data, entry=name)
        except ManifestError as exc:
            unreadable.append(Unreadable(name, where.name, str(exc)))
        except KeyError as exc:
            if type(exc) is not KeyError:  # EntryRejected: failed its digest or signature
                reads += 1
                unreadable.append(Unreadable(name, where.name, str(exc.args[0]) if exc.args else "rejected"))
        except Exception as exc:
            if where is view:
                unreadable.append(Unreadable(name, where.name, one_line(exc)))
            else:  # a slower tier that is down: the entry's manifest is not known to be bad
                notes.append(f"tier {where.name}: could not read the manifest ({one_line(exc)})")
        return None

    store = view.store
    if store is not None:
        manifest = read_in(view, lambda: store.read_entry(manifest_name(name))
                           if listed and manifest_name(name) in listed else None)  # fmt: skip
    else:
        manifest = read_in(view, lambda: view.held(manifest_key(key)))
    if manifest is None and not unreadable:
        for other in slower:
            if other.store is None:
                continue
            other_store = other.store
            manifest = read_in(other, lambda: other_store.read_entry(manifest_name(name)))
            if manifest is not None:
                notes.append(f"manifest read from tier {other.name} ({other.location}): tier {view.name} has none")
            if manifest is not None or unreadable:
                break
    return Explanation(name, True, view.name, view.location, manifest, inputs, (), tuple(unreadable),
                       reads, tuple(notes))  # fmt: skip


def _miss(
    name: str, inputs: CompileInputs, listings: list[tuple[_View, dict[str, StoredEntry]]], notes: list[str]
) -> Explanation:
    bound = max_stored_bytes(MAX_MANIFEST_BYTES)
    seen: set[str] = set()
    found: list[tuple[_View, str, StoredEntry]] = []  # (tier, entry name, its manifest's listing)
    unreadable: list[Unreadable] = []
    for view, listed in listings:
        for entry in listed:
            m = manifest_name(entry)
            if m in listed and entry not in seen and entry != name:
                seen.add(entry)
                if listed[m].size > bound:
                    unreadable.append(Unreadable(entry, view.name, f"{listed[m].size} bytes, over the "
                                                 f"{MAX_MANIFEST_BYTES}-byte manifest bound (not read)"))  # fmt: skip
                else:
                    found.append((view, entry, listed[m]))
    found.sort(key=lambda item: -(item[2].mtime or 0.0))
    chosen = found[:MAX_MANIFEST_READS]
    if len(found) > len(chosen):
        notes.append(f"read the {len(chosen)} newest of {len(found)} manifests")
    candidates: list[tuple[tuple[int, int, float], Candidate]] = []
    read = 0
    for view in {v.name: v for v, _, _ in chosen}.values():  # each tier once, fastest first (names are unique)
        assert view.store is not None
        wanted = {manifest_name(entry): (entry, listing) for v, entry, listing in chosen if v is view}
        try:
            results = view.store.read_many(list(wanted))
        except Exception as exc:
            notes.append(f"tier {view.name}: could not read manifests ({one_line(exc)})")
            continue
        for m, (entry, listing) in wanted.items():
            read += 1
            result = results.hits.get(m)
            if result is None:
                error = results.errors.get(m)
                reason = "gone since listed" if error is None else one_line(error)
                unreadable.append(Unreadable(entry, view.name, reason))
                continue
            try:
                stored = decode_manifest(result, entry=entry)
            except ManifestError as exc:
                unreadable.append(Unreadable(entry, view.name, str(exc)))
                continue
            near = _similarity(inputs, stored.inputs)
            if near is None:
                continue
            diffs = differences(inputs, stored.inputs)
            rank = (near[0], len(diffs), -(listing.mtime or 0.0))
            candidates.append((rank, Candidate(entry, view.name, near[1], stored, diffs)))
    candidates.sort(key=lambda item: item[0])
    best = tuple(c for _, c in candidates[:MAX_CANDIDATES])
    return Explanation(name, False, None, None, None, inputs, best, tuple(unreadable), read, tuple(notes))


# -- one entry's manifest, by name (``tiered-progcache explain NAME``) --------------------------------


@dataclasses.dataclass(frozen=True)
class StoredManifest:
    """What a store holds for one entry name. Immutable.

    ``manifest`` is set when found and readable; else ``problem`` says why not:
    ``"no entry"``, ``"no manifest"`` (an entry without one: stored by
    ``Program.compile(cache=...)`` or before manifests), or ``"unreadable manifest: ..."``.
    ``read_from`` is the location of the shared store the manifest was read from where
    the store holding the entry has none (a hit promoted from the remote), else None.
    """

    name: str
    manifest: Manifest | None
    problem: str | None
    read_from: str | None = None


def stored_manifest(
    store: EntryStore, name: str, *, shared: Callable[[], EntryStore | None] | None = None
) -> StoredManifest:
    """The manifest of entry ``name`` in ``store`` (``name`` may also be a manifest's own name).

    Two reads at most in ``store``: the manifest, and the entry itself where there is no
    manifest (to tell "no entry" from "no manifest"). Where ``store`` holds the entry
    but no manifest, ``shared()`` (called then only; None: no shared store) gives the
    shared store to read it from, one read more: ``compile()`` wrote it there, and a hit
    promoted the binary alone. ``ValueError`` for a name that is not an entry name;
    failures of ``store`` propagate (the command reports them); a shared store that
    fails leaves the answer "no manifest".
    """
    found = _stored_manifest(store, name)
    if found.problem != "no manifest" or shared is None:
        return found
    try:
        other = shared()
        if other is None:
            return found
        data = other.read_entry(manifest_name(name))
    except Exception as exc:  # KeyError: not there either; anything else: the shared store is down
        if type(exc) is not KeyError:
            logger.warning("could not read the manifest of %s from the shared store: %s", name[:12], one_line(exc))
        return found
    try:
        return StoredManifest(name, decode_manifest(data, entry=name), None, other.location)
    except ManifestError as exc:
        return StoredManifest(name, None, f"unreadable manifest: {exc}", other.location)


def _stored_manifest(store: EntryStore, name: str) -> StoredManifest:
    check_entry_name(name)
    try:
        data = store.read_entry(manifest_name(name))
    except KeyError as exc:
        if type(exc) is not KeyError:  # EntryRejected: failed its digest or signature
            return StoredManifest(name, None, f"unreadable manifest: {exc.args[0] if exc.args else exc}")
    else:
        try:
            return StoredManifest(name, decode_manifest(data, entry=name), None)
        except ManifestError as exc:
            return StoredManifest(name, None, f"unreadable manifest: {exc}")
    try:
        own = store.read_entry(name)
    except KeyError as exc:
        if type(exc) is not KeyError:
            return StoredManifest(name, None, f"no manifest, and the entry is unreadable: {exc.args[0] if exc.args else exc}")
        return StoredManifest(name, None, "no entry")
    try:
        return StoredManifest(name, decode_manifest(own), None)  # the name of a manifest itself
    except ManifestError:
        return StoredManifest(name, None, "no manifest")
