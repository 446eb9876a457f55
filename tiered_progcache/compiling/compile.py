"""``compile()``: a cached NVRTC/NVVM/linker compile that runs the compiler once per key.

What ``Program.compile(cache=...)`` does, plus three things it cannot:

* single-flight on a miss, per thread, per node (a file lock under the local cache
  directory) and per cluster (a lease in the shared remote), re-checking the tiers
  after each lock, so N ranks and M nodes starting together compile each kernel once;
* compiles with ``include_path`` / ``pre_include`` / NVVM ``use_libdevice`` are
  cached, keyed by the content of the headers they can read (:mod:`.headerscan`), by
  role rather than location, so hosts with the same headers elsewhere share entries
  (:mod:`.keys`);
* compiles with ``name_expressions`` are cached: the symbol mapping is stored
  beside the binary as a small JSON document, so ``get_kernel("f<int>")`` works on a hit;
* every compile it runs leaves a manifest beside its binary (:mod:`.manifest`: what it
  was compiled from, where, when, how long), and with ``explain_misses`` on the cache
  (``TIERED_PROGCACHE_EXPLAIN=1``) each miss logs why it missed (:mod:`.explain`).

The compiler's exceptions reach the caller unchanged. The flight across threads,
processes and nodes is :mod:`tiered_progcache.cluster.singleflight`'s: locks released on
every path, every wait bounded by ``wait_timeout``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import cachetools
from cuda.core import ObjectCode, Program, ProgramOptions
from cuda.core.utils import ProgramCacheResource

from .compileargs import check_arguments, knobs_for
from ..chain.defaultcache import default_cache
from ..chain.stats import MetadataKey
from .explain import explain_key
from ..cluster.flightpolicy import compile_size, compile_times
from ..hooks import call_each, subscribe
from .keys import CompileKey, compile_key
from . import direct
from .manifest import (
    ManifestError,
    build_manifest,
    compile_inputs,
    compile_seconds_of,
    encode_manifest,
    manifest_key,
)
from ..cluster.singleflight import SHORT, plan, predict, run_once
from ..settings import DEFAULT_LEASE_TTL_S, DEFAULT_WAIT_TIMEOUT_S
from ..stores.store import entry_name
from .symbols import SymbolMapping, decode_symbols, encode_symbols, symbols_key
from ..chain.tiered import TieredProgramCache, as_chain
from .visible import log_requested

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_WAIT_TIMEOUT_S",
    "CompileEvent",
    "HitEvent",
    "check_arguments",
    "compile",
    "compile_count",
    "declined_count",
    "default_cache",
    "on_compile",
    "on_hit",
    "symbols_key",
]

logger = logging.getLogger(__name__)

_FROM_BYTES = {"cubin": ObjectCode.from_cubin, "ptx": ObjectCode.from_ptx, "ltoir": ObjectCode.from_ltoir}


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One run of the compiler by :func:`compile` (a cache miss that compiled). Immutable.

    ``key`` is the cache key, ``seconds`` the compiler's wall time, ``ok`` False when it
    raised (the error then propagates to the caller).
    """

    key: bytes
    code_type: str
    target_type: str
    seconds: float
    ok: bool


@dataclasses.dataclass(frozen=True)
class HitEvent:
    """One :func:`compile` answered from the cache. Immutable.

    ``saved_seconds`` is the compile time the entry's manifest records (what the hit
    saved), None where it has no readable manifest (stored by ``Program.compile(cache=...)``,
    or before manifests).
    """

    key: bytes
    saved_seconds: float | None


# -- compile counter and hooks ---------------------------------------------------------------

_counter_lock = threading.Lock()
_compiles = 0
_hooks: list[Callable[[CompileEvent], None]] = []


_declined = 0


def declined_count() -> int:
    """Compiles :func:`compile` ran without the cache because what they read cannot be known
    (a computed include the header scan cannot resolve within bounds; ``CompileKey.declined``). Per process."""
    return _declined


def compile_count() -> int:
    """Compiler runs by :func:`compile` in this process so far (failed ones too).

    Thread-safe. Per process: a forked child starts from its parent's count.
    """
    return _compiles


def on_compile(hook: Callable[[CompileEvent], None]) -> Callable[[], None]:
    """Call ``hook(event)`` after every compiler run in this process; returns an unsubscribe.

    >>> stop = on_compile(lambda e: log.write(f"{e.key.hex()} {e.seconds:.3f}\\n"))

    The hook runs on the compiling thread, while the key's locks are held: keep it
    short, and do not call :func:`compile` from it. Exceptions it raises are logged
    and swallowed. Thread-safe.
    """
    return subscribe(_hooks, _counter_lock, hook)



_hit_hooks: list[Callable[[HitEvent], None]] = []
#: Compile seconds per (cache, key), as the manifests say, for ``on_hit``: each is read once per process.
_MAX_SAVED = 65536
# An LRU (reads reorder it): read and written under _counter_lock.
_saved: cachetools.LRUCache[tuple[int, bytes], float | None] = cachetools.LRUCache(_MAX_SAVED)


def on_hit(hook: Callable[[HitEvent], None]) -> Callable[[], None]:
    """Call ``hook(event)`` after every :func:`compile` answered from the cache; returns an unsubscribe.

    What it costs: nothing while no hook is subscribed; with one, the first hit of each
    key in this process also reads that entry's manifest from the first tier holding it
    (not counted in ``stats()``, not promoted), later hits a dict lookup. The hook runs
    on the calling thread; exceptions it raises are logged and swallowed. Thread-safe.
    ``tiered_progcache.metrics`` sums ``saved_seconds`` into ``compile_seconds_saved``.
    """
    return subscribe(_hit_hooks, _counter_lock, hook)


def _record_hit(cache: TieredProgramCache, key: bytes) -> None:
    """The hit's saved compile seconds to the hooks and to the chain's tally (``stats``).

    For the tally alone, the manifest is looked for only in the tiers on this node (memory,
    local): a hit never costs a request to a shared tier it would not have made. With an
    ``on_hit`` hook subscribed, every tier is asked, as that hook documents.
    """
    memo = (id(cache.identity), key)
    with _counter_lock:
        hooks = list(_hit_hooks)
        known = memo in _saved
        seconds = _saved[memo] if known else None
    tally = cache.compile_tally
    if not known:
        seconds = _manifest_seconds(cache, key, shared=bool(hooks))
        _remember_seconds(memo, seconds)  # once per key and process: later hits are a dict lookup
    tally.count_saved(seconds)
    if hooks:
        call_each(hooks, HitEvent(key, seconds), logger, "on_hit")


def _manifest_seconds(cache: TieredProgramCache, key: bytes, *, shared: bool = True) -> float | None:
    """The compile time entry ``key``'s manifest records, or None: a metadata read through the chain (no
    lookup counted; failures counted and skipped by its policy). ``shared=False``: the tiers on this node only."""
    data = cache.get(MetadataKey(manifest_key(key)), where="all" if shared else "nearby")
    if data is None:
        return None
    try:
        return compile_seconds_of(data, entry=entry_name(key))
    except ManifestError:
        return None


def _remember_seconds(memo: tuple[int, bytes], seconds: float | None) -> None:
    with _counter_lock:
        _saved[memo] = seconds


def _record_compile(event: CompileEvent) -> None:
    global _compiles
    with _counter_lock:
        _compiles += 1
        hooks = list(_hooks)
    call_each(hooks, event, logger, "on_compile")


# -- the helper ------------------------------------------------------------------------------------


def _header_scans_dir(cache: TieredProgramCache) -> str | None:
    """Where header scans persist for the next process: the cache's local directory, if it has one."""
    local = cache.local_store
    return local.header_scans_dir if local is not None else None


class _Outcome(NamedTuple):
    """What the thread that compiled hands to the threads that waited for it."""

    data: bytes
    mapping: SymbolMapping | None


def compile(  # noqa: A001 - the name users look for; the builtin is not used here
    source: str | bytes,
    code_type: str = "c++",
    options: ProgramOptions | None = None,
    target_type: str = "cubin",
    *,
    cache: ProgramCacheResource | None = None,
    name_expressions: Sequence[str | bytes] = (),
    extra_digest: bytes | None = None,
    logs: Any = None,
    single_flight: bool | None = None,
    wait_timeout: float | None = None,
    lease_ttl: float | None = None,
    header_recheck_s: float | None = None,
    portable_keys: bool | None = None,
) -> ObjectCode:
    """Compile ``source`` unless an equal compile is cached; compile each key once per cluster.

    >>> obj = tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_90", include_path=[cccl]),
    ...                                name_expressions=["scale<float>"])
    >>> kernel = obj.get_kernel("scale<float>")          # works on a hit too

    The key is cuda-core's ``make_program_cache_key``; ``extra_digest`` is mixed with the
    digest of the headers the compile can read (only when it reads any, so plain compiles
    share entries with ``Program.compile(cache=...)``). ``portable_keys`` (default) keys
    include directories by role and header content, not location
    (:func:`tiered_progcache.compiling.keys.compile_key`). On a miss, with ``single_flight``
    (default), one thread per process, one process per local directory and one node per
    remote compiles; the others wait up to ``wait_timeout`` seconds and get its entry. Which
    of the flight's three cases a miss takes (short: race the lookup; the lease; the node lock
    only) is :func:`tiered_progcache.cluster.singleflight.plan`'s (docs/cluster.md, "When
    nodes wait"). ``lease_ttl`` bounds how long a crashed node holds the others up.
    ``header_recheck_s`` lets a process trust a header scan that long (0: look every call).
    ``logs`` receives the compiler log on a miss only. A bare ``ProgramCacheResource`` is used
    as a chain of one tier (:func:`~tiered_progcache.chain.tiered.as_chain`).

    ``single_flight``, ``wait_timeout``, ``lease_ttl``, ``header_recheck_s`` and
    ``portable_keys`` left out (None) are the cache's settings (docs/configuration.md).
    Safe from any number of threads and processes at once. Compiler errors propagate to the
    caller and to the threads and nodes waiting on it.
    """
    names = check_arguments(source, code_type, options, target_type, cache, name_expressions, extra_digest,
                            single_flight, wait_timeout, lease_ttl, header_recheck_s, portable_keys)
    if options is None:
        options = ProgramOptions()
    cache = as_chain(default_cache() if cache is None else cache)  # only chains travel inward
    single_flight, wait_timeout, lease_ttl, header_recheck_s, portable_keys = knobs_for(
        cache, single_flight, wait_timeout, lease_ttl, header_recheck_s, portable_keys)
    compiled = direct.compile_key(cache, source, code_type, options, target_type, names, extra_digest,
                                  portable=portable_keys, recheck_s=header_recheck_s, memo_dir=_header_scans_dir(cache))
    key = compiled.key
    target = target_type.lower()
    if compiled.declined is not None:
        return _compile_declined(cache, compiled, source, code_type, options, target, names, logs)
    size = compile_size(len(source), len(compiled.headers))
    estimate = predict(cache, code_type, target, size)
    case, _ = plan(cache, estimate) if single_flight else (None, None)
    found = _find(cache, key, target, options, names, nearby_only=case == SHORT)  # a short race looks nearby first
    if found is not None:
        _record_hit(cache, key)
        return found[0]
    if cache.explain_misses:
        _explain_miss(source, code_type, options, target, cache, names, extra_digest, compiled)
    job = _Job(cache, compiled, source, code_type, options, target, names, extra_digest, logs, size)
    if case is None:
        return _compile_and_store(cache, job)[0]
    return run_once(cache, key, job, wait_timeout=wait_timeout, lease_ttl=lease_ttl, case=case, estimate_s=estimate)


def _compile_declined(
    cache: TieredProgramCache, compiled: CompileKey, source: str | bytes, code_type: str,
    options: ProgramOptions, target: str, names: tuple[str | bytes, ...], logs: Any,
) -> ObjectCode:
    """Compile without the cache: never looked up, never stored (what it reads cannot be keyed)."""
    global _declined
    with _counter_lock:
        _declined += 1
    if cache.compile_tally.count_uncacheable(compiled.declined, compiled.key):  # stats(): `uncacheable`, by reason
        logger.warning("not cached %s, compiled every time (counted as uncacheable): %s", compiled.key[:8].hex(),
                       compiled.declined)  # fmt: skip
    return _run_compiler(compiled.key, source, code_type, options, target, names, logs, cache.compile_tally)[0]


def _run_compiler(key: bytes, source: str | bytes, code_type: str, options: ProgramOptions, target: str,
                  names: tuple[str | bytes, ...], logs: Any, tally: Any = None) -> tuple[ObjectCode, float]:
    """The compiler's output and wall time, counted and handed to the ``on_compile`` hooks (failures too)."""
    started = time.perf_counter()
    program = Program(source, code_type, options)
    try:
        obj = program.compile(target, name_expressions=names, logs=logs)
    except BaseException:
        failed_after = time.perf_counter() - started
        compile_times.record(code_type, target, math.nan, 1)  # not a rate, but the compiler's first use is past
        if tally is not None:
            tally.count_compile(failed_after)
        _record_compile(CompileEvent(key, code_type, target, failed_after, ok=False))
        raise
    finally:
        program.close()
        # Drop it now: a traceback would keep it in a reference cycle, and cuda-core's
        # Program.__dealloc__ fails when the cycle collector has cleared its options first.
        del program
    seconds = time.perf_counter() - started
    if tally is not None:
        tally.count_compile(seconds)
    _record_compile(CompileEvent(key, code_type, target, seconds, ok=True))
    return obj, seconds


def _find(
    cache: TieredProgramCache,
    key: bytes,
    target: str,
    options: ProgramOptions,
    names: tuple[str | bytes, ...],
    nearby_only: bool = False,
    shared_only: bool = False,
    recheck: bool = False,
) -> tuple[ObjectCode, _Outcome] | None:
    """The cached entry as an ObjectCode (with its symbol mapping when names are asked for), or None.

    ``nearby_only``: only the tiers in front of the shared one (the chain's ``get(where="nearby")``);
    ``shared_only``: only the others (``where="shared"``). ``recheck``: a look again after a miss
    (under the node lock or the lease), read as metadata is, so each ``compile()`` call is one
    lookup in ``hits``/``misses``; what the look again found is the flight's decision.
    """
    where = "nearby" if nearby_only else "shared" if shared_only else "all"
    data = cache.get(MetadataKey(key) if recheck else key, where=where)
    if data is None:
        return None
    mapping = None
    if names:
        mapping = decode_symbols(cache.get(symbols_key(key), where=where), names)
        if mapping is None:
            logger.info("entry %s has no usable symbol mapping: compiling again", key[:8].hex())
            return None
    return _wrap(data, target, options, mapping), _Outcome(data, mapping)


def _wrap(data: bytes, target: str, options: ProgramOptions, mapping: SymbolMapping | None) -> ObjectCode:
    name = options.name or ""
    return _FROM_BYTES[target](data, name=name, symbol_mapping=dict(mapping) if mapping else None)


@dataclasses.dataclass(frozen=True)
class _Job:
    """One missed compile: its key and everything the compiler and the manifest need, and the flight's three verbs."""

    cache: TieredProgramCache
    compiled: CompileKey
    source: str | bytes
    code_type: str
    options: ProgramOptions
    target: str
    names: tuple[str | bytes, ...]
    extra_digest: bytes | None
    logs: Any
    size: int

    def find(self, shared_only: bool = False) -> tuple[ObjectCode, _Outcome] | None:
        """The entry, once single-flight gave this caller its turn (a hit is another's compile, saved).

        ``shared_only`` (a race's lookup): the shared tiers alone, and its hit is recorded only if it is the answer.
        """
        found = _find(self.cache, self.compiled.key, self.target, self.options, self.names, shared_only=shared_only,
                      recheck=not shared_only)
        if found is not None and not shared_only:
            _record_hit(self.cache, self.compiled.key)
        return found

    def produce(self, dropped: threading.Event | None = None) -> tuple[ObjectCode, _Outcome]:
        return _compile_and_store(self.cache, self, dropped)

    def adopt(self, outcome: _Outcome, found: bool = False) -> ObjectCode:
        """Another thread's outcome as this one's result; ``found``: it came from a race's lookup (a hit)."""
        if found:
            _record_hit(self.cache, self.compiled.key)
        return _wrap(outcome.data, self.target, self.options, outcome.mapping)


def _compile_and_store(
    cache: TieredProgramCache, job: _Job, dropped: threading.Event | None = None
) -> tuple[ObjectCode, _Outcome]:
    """Run the compiler and store what it made (not if ``dropped`` is set by then: a race the lookup won)."""
    key, code_type, target, names = job.compiled.key, job.code_type, job.target, job.names
    obj, seconds = _run_compiler(key, job.source, code_type, job.options, target, names, job.logs, cache.compile_tally)
    compile_times.record(code_type, target, seconds, job.size)  # what the flight plans the next compile with
    _save_times(cache)
    _remember_seconds((id(cache.identity), key), round(seconds, 6))  # what the manifest records
    data = bytes(obj.code)
    mapping = dict(obj.symbol_mapping) if names else None
    if dropped is not None and dropped.is_set():
        return obj, _Outcome(data, mapping)  # the lookup won the race: the entry is stored already
    # The manifest before the binary (like the symbol map): whoever sees the binary finds
    # its manifest. A manifest that cannot be made or stored costs nothing but itself.
    try:
        _store(cache, manifest_key(key), _manifest_bytes(job, seconds), seconds)
    except Exception as exc:
        logger.warning("could not store the manifest of entry %s: %r", key[:8].hex(), exc)
    if names:  # the mapping first: whoever sees the binary must find its mapping (the chain's put never raises)
        _store(cache, symbols_key(key), encode_symbols(mapping or {}), seconds)
    _store(cache, key, data, seconds)
    direct.record(cache, job.compiled, job.source, code_type, job.options, target, names, job.extra_digest, seconds)
    return obj, _Outcome(data, mapping)


def _save_times(cache: TieredProgramCache) -> None:
    """Keep this node's compile rates and its store's round trip in its local directory for its next process."""
    local = cache.local_store
    if local is None:
        return
    directory = os.fspath(local.root)
    shared = cache.shared_store
    if shared is not None:
        compile_times.note_round_trip(shared.location, shared.round_trip_s)
    try:
        compile_times.save(directory)
    except OSError as exc:
        logger.debug("could not save compile times in %s: %r", directory, exc)


def _manifest_bytes(job: _Job, seconds: float) -> bytes:
    inputs = compile_inputs(job.compiled, job.source, job.code_type, job.options, job.target, job.names,
                            job.extra_digest)  # fmt: skip
    try:
        return encode_manifest(build_manifest(job.compiled.key, inputs, seconds))
    except ManifestError:
        raise
    except Exception as exc:  # a bug here must not cost the compile: say so and store none
        raise ManifestError(f"could not build the manifest: {exc!r}") from exc


def _explain_miss(
    source: str | bytes, code_type: str, options: ProgramOptions, target: str, cache: TieredProgramCache,
    names: tuple[str | bytes, ...], extra_digest: bytes | None, compiled: CompileKey,
) -> None:
    """One INFO line saying why this compile missed (``explain_misses``); never raises."""
    try:
        report = explain_key(compiled, source, code_type, options, target, cache, names, extra_digest)
    except Exception as exc:
        log_requested(logger, logging.INFO, "miss %s: could not explain it: %r", compiled.key[:8].hex(), exc)
        return
    log_requested(logger, logging.INFO, "%s", report.one_line())  # on stderr if the application set up no logging


def _store(cache: TieredProgramCache, key: bytes, data: bytes, seconds: float) -> None:
    """Store with the compile time, so the chain applies admission by it (``min_upload_compile_s``)."""
    cache.put(key, data, compile_seconds=seconds)
