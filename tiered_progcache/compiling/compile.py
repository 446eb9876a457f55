"""``compile()``: a cached NVRTC/NVVM/linker compile that runs the compiler once per key.

What ``Program.compile(cache=...)`` does, plus single-flight per thread, node and cluster
(:mod:`tiered_progcache.cluster.singleflight`), compiles that read headers or name expressions
cached, and a manifest beside every binary it compiles. The compiler's exceptions reach the
caller unchanged. docs/architecture.md and docs/cluster.md say how and why.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import cachetools
from cuda.core import ObjectCode, Program, ProgramOptions
from cuda.core.utils import ProgramCacheResource

from .compileargs import check_arguments, knobs_for
from ..chain.defaultcache import default_cache
from ..chain.stats import MetadataKey
from .explain import explain_key
from ..cluster.flightpolicy import DEFER_PAST_FILES, compile_size, compile_times
from ..hooks import call_each, subscribe
from . import keys
from .headermemo import is_racy
from .headerscan import adopt_scan
from .keys import CompileKey
from . import direct, nvrtcload
from .manifest import (
    ManifestError,
    build_manifest,
    compile_inputs,
    compile_seconds_of,
    encode_manifest,
    manifest_key,
)
from ..cluster.singleflight import SHORT, plan, predict, run_once, settle
from ..settings import DEFAULT_LEASE_TTL_S, DEFAULT_WAIT_TIMEOUT_S
from ..stores.store import entry_name
from .symbols import SymbolMapping, decode_symbols, encode_symbols, symbols_key
from ..chain.tiered import TieredProgramCache, as_chain
from .visible import log_requested

__all__ = ["DEFAULT_LEASE_TTL_S", "DEFAULT_WAIT_TIMEOUT_S", "CompileEvent", "HitEvent", "check_arguments", "compile",
           "compile_count", "declined_count", "default_cache", "on_compile", "on_hit", "symbols_key"]

logger = logging.getLogger(__name__)

_FROM_BYTES = {"cubin": ObjectCode.from_cubin, "ptx": ObjectCode.from_ptx, "ltoir": ObjectCode.from_ltoir}


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One compiler run by :func:`compile` (a miss): ``seconds`` its wall time, ``ok`` False if it raised. Immutable."""

    key: bytes
    code_type: str
    target_type: str
    seconds: float
    ok: bool


@dataclasses.dataclass(frozen=True)
class HitEvent:
    """One :func:`compile` answered from the cache. Immutable.

    ``saved_seconds``: the compile time the entry's manifest records (what the hit saved), None without one.
    """

    key: bytes
    saved_seconds: float | None


# -- compile counter and hooks ---------------------------------------------------------------

_counter_lock = threading.Lock()
_compiles = 0
_declined = 0
_hooks: list[Callable[[CompileEvent], None]] = []


def declined_count() -> int:
    """Compiles :func:`compile` ran without the cache because what they read cannot be known
    (a computed include the header scan cannot resolve within bounds; ``CompileKey.declined``). Per process."""
    return _declined


def compile_count() -> int:
    """Compiler runs by :func:`compile` in this process so far, failed ones too (a forked child: its parent's too)."""
    return _compiles


def on_compile(hook: Callable[[CompileEvent], None]) -> Callable[[], None]:
    """Call ``hook(event)`` after every compiler run in this process; returns an unsubscribe.

    >>> stop = on_compile(lambda e: log.write(f"{e.key.hex()} {e.seconds:.3f}\\n"))

    The hook runs on the compiling thread, while the key's locks are held: keep it short, do not call
    :func:`compile` from it. Exceptions it raises are logged and swallowed. Thread-safe.
    """
    return subscribe(_hooks, _counter_lock, hook)


_hit_hooks: list[Callable[[HitEvent], None]] = []
#: Compile seconds per (cache, key), as the manifests say, for ``on_hit``: each is read once per process.
_MAX_SAVED = 65536
# An LRU (reads reorder it): read and written under _counter_lock. Keyed by id(cache.identity), each value
# holds its cache weakly: once that cache is gone its id may name a new one, whose entries it must not answer.
_saved: cachetools.LRUCache[tuple[int, bytes], tuple[weakref.ref[object], float | None]] = \
    cachetools.LRUCache(_MAX_SAVED)


def _remember_saved(cache: TieredProgramCache, key: bytes, seconds: float | None) -> None:
    """Under _counter_lock: ``seconds`` as what entry ``key`` of ``cache`` saves."""
    identity = cache.identity
    _saved[(id(identity), key)] = (weakref.ref(identity), seconds)


def on_hit(hook: Callable[[HitEvent], None]) -> Callable[[], None]:
    """Call ``hook(event)`` after every :func:`compile` answered from the cache; returns an unsubscribe.

    With a hook subscribed, the first hit of each key in this process also reads that entry's
    manifest from the first tier holding it (not counted, not promoted). The hook runs on the
    calling thread; exceptions it raises are logged and swallowed. Thread-safe.
    """
    return subscribe(_hit_hooks, _counter_lock, hook)


def _record_hit(cache: TieredProgramCache, key: bytes) -> None:
    """The hit's saved compile seconds to the hooks and to the chain's tally (``stats``).

    For the tally alone the manifest is read when the tally is (``count_saved_later``), from the tiers
    on this node only: a hit costs no extra read then, and never an extra shared request.
    """
    with _counter_lock:
        hooks = list(_hit_hooks)
        identity = cache.identity
        owner, seconds = _saved.get((id(identity), key), (None, None))
        known = owner is not None and owner() is identity
    if not known and not hooks:
        cache.compile_tally.count_saved_later(key, functools.partial(_saved_seconds, cache, key, shared=False))
        return
    if not known:
        seconds = _saved_seconds(cache, key, shared=True)
    cache.compile_tally.count_saved(seconds)
    if hooks:
        call_each(hooks, HitEvent(key, seconds), logger, "on_hit")


def _saved_seconds(cache: TieredProgramCache, key: bytes, *, shared: bool) -> float | None:
    """The compile time entry ``key``'s manifest records, or None, remembered for this process: a metadata
    read through the chain (no lookup counted; failures counted and skipped by its policy). ``shared=False``:
    the tiers on this node only."""
    data = cache.get(MetadataKey(manifest_key(key)), where="all" if shared else "nearby")
    try:
        seconds = compile_seconds_of(data, entry=entry_name(key))
    except ManifestError:  # none there, or one that does not hold
        seconds = None
    with _counter_lock:
        _remember_saved(cache, key, seconds)  # once per key and process: later hits are a dict lookup
    return seconds


def _record_compile(event: CompileEvent) -> None:
    global _compiles
    with _counter_lock:
        _compiles += 1
        hooks = list(_hooks)
    call_each(hooks, event, logger, "on_compile")


# -- compile() and the job it hands the flight ---------------------------------------------------------


class _Entry(NamedTuple):
    """An entry's binary and its symbol mapping: what the thread that compiled hands to those that waited."""

    data: bytes
    mapping: SymbolMapping | None

    @classmethod
    def of(cls, obj: ObjectCode, names: tuple[str | bytes, ...]) -> _Entry:
        """What the compiler made, as waiters get it (the symbol mapping only where names were asked for)."""
        return cls(bytes(obj.code), dict(obj.symbol_mapping) if names else None)


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

    The key is cuda-core's, mixed with the content of the headers the compile reads. On a miss one
    thread, process and node compiles (``single_flight``); the others wait up to ``wait_timeout``
    and get its entry, or its error. ``lease_ttl`` bounds how long a crashed node holds them up;
    ``header_recheck_s`` how long a header scan is trusted; ``portable_keys`` keys include
    directories by role, not location; ``logs`` gets the compiler log on a miss. Knobs left out are
    the cache's settings (docs/configuration.md); docs/cluster.md has the flight. Thread- and process-safe.
    """
    names = check_arguments(source, code_type, options, target_type, cache, name_expressions, extra_digest,
                            single_flight, wait_timeout, lease_ttl, header_recheck_s, portable_keys)
    if options is None:
        options = ProgramOptions()
    cache = as_chain(default_cache() if cache is None else cache)  # only chains travel inward
    single_flight, wait_timeout, lease_ttl, header_recheck_s, portable_keys = knobs_for(
        cache, single_flight, wait_timeout, lease_ttl, header_recheck_s, portable_keys)
    local = cache.local_store
    memo_dir = None if local is None else local.header_scans_dir
    if local is not None:
        nvrtcload.start(local.root)  # the first call's NVRTC load beside its header work, where the node recorded it
    request = _Request(cache, source, code_type, options, target_type.lower(), names, extra_digest, logs)
    compiled = direct.compile_key(cache, source, code_type, options, target_type, names, extra_digest,
                                  portable=portable_keys, recheck_s=header_recheck_s, memo_dir=memo_dir,
                                  defer_past_files=DEFER_PAST_FILES if single_flight else None)
    if local is not None and not isinstance(compiled, direct.Unscanned):  # (cuda-core's key loaded NVRTC)
        nvrtcload.record(local.root)
    if isinstance(compiled, direct.Unscanned):  # no node recorded its headers: flown by its direct key
        unscanned = _Unscanned(request, compiled, functools.partial(
            keys.compile_key, source, code_type, options, target_type, names, extra_digest, portable=portable_keys,
            recheck_s=header_recheck_s, memo_dir=memo_dir, memoize_scan=False))
        try:
            return run_once(cache, compiled.storage, unscanned, wait_timeout=wait_timeout, lease_ttl=lease_ttl,
                            case=plan(cache, math.inf)[0], inputs=unscanned.inputs)
        except _Declined as declined:
            return _compile_declined(declined.job)
        finally:
            unscanned.remember_scan()
    job = _Job(request, compiled)
    if compiled.declined is not None:
        return _compile_declined(job)
    estimate = predict(cache, code_type, request.target, job.size)
    case, _ = plan(cache, estimate) if single_flight else (None, None)
    # A race looks nearby (its shared lookup runs beside the compile); so does a key no node recorded a compile
    # for (``unrecorded``): the look under the flight's lock asks the shared tier, one round trip, not two.
    nearby_only = case == SHORT or (case is not None and compiled.unrecorded)
    found = request.find(compiled.key, "nearby" if nearby_only else "all")
    if found is not None:
        _record_hit(cache, compiled.key)
        return found[0]
    if cache.explain_misses:
        _explain_miss(job)
    if case is None:
        return job.produce()[0]
    return run_once(cache, compiled.key, job, wait_timeout=wait_timeout, lease_ttl=lease_ttl, case=case,
                    estimate_s=estimate)


def _compile_declined(job: _Job, run: _CompilerRun | None = None) -> ObjectCode:
    """Compile without the cache (``run``: a compile already started): never looked up, never stored."""
    global _declined
    with _counter_lock:
        _declined += 1
    compiled = job.compiled
    if job.request.cache.compile_tally.count_uncacheable(compiled.declined, compiled.key):  # stats(): `uncacheable`
        logger.warning("not cached %s, compiled every time (counted as uncacheable): %s", compiled.key[:8].hex(),
                       compiled.declined)  # fmt: skip
    return job.count(job.request.run_compiler() if run is None else run)[0]


@dataclasses.dataclass
class _CompilerRun:
    """One compiler run's outcome (its output or exception, its wall and CPU time), for ``_Job.count`` to count."""

    obj: ObjectCode | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Request:
    """One ``compile()`` call: its cache and what the compiler gets, shared by every verb of its flight."""

    cache: TieredProgramCache
    source: str | bytes
    code_type: str
    options: ProgramOptions
    target: str
    names: tuple[str | bytes, ...]
    extra_digest: bytes | None
    logs: Any

    def find(self, key: bytes, where: str = "all", recheck: bool = False) -> tuple[ObjectCode, _Entry] | None:
        """Entry ``key`` as an ObjectCode (with its symbol mapping when names are asked for), or None.

        ``where``: the chain's tiers asked. ``recheck`` (a look again under a lock) reads as
        metadata, so each ``compile()`` is one lookup in ``hits``.
        """
        data = self.cache.get(MetadataKey(key) if recheck else key, where=where)
        if data is None:
            return None
        mapping = None
        if self.names:
            mapping = decode_symbols(self.cache.get(symbols_key(key), where=where), self.names)
            if mapping is None:
                logger.info("entry %s has no usable symbol mapping: compiling again", key[:8].hex())
                return None
        entry = _Entry(data, mapping)
        return self.wrap(entry), entry

    def wrap(self, entry: _Entry) -> ObjectCode:
        mapping = dict(entry.mapping) if entry.mapping else None
        return _FROM_BYTES[self.target](entry.data, name=self.options.name or "", symbol_mapping=mapping)

    def run_compiler(self) -> _CompilerRun:
        """Run the compiler on this thread; its output or exception, not raised here (``_Job.count`` counts, then
        raises)."""
        run = _CompilerRun()
        started, cpu_started = time.perf_counter(), time.thread_time()
        program = Program(self.source, self.code_type, self.options)
        try:
            run.obj = program.compile(self.target, name_expressions=self.names, logs=self.logs)
        except BaseException as exc:
            run.error = exc
        finally:
            # CPU time read inside the wall-clock span, so it never exceeds it
            run.cpu_seconds = time.thread_time() - cpu_started
            run.seconds = time.perf_counter() - started
            program.close()
            # Drop it now: a traceback would keep it in a reference cycle, and cuda-core's
            # Program.__dealloc__ fails when the cycle collector has cleared its options first.
            del program
        return run

    def record_set(self, compiled: CompileKey, seconds: float | None = None, *,
                   mark_no_set: bytes | None = None) -> None:
        """Add the header set ``compiled`` read to its direct manifest (:func:`.direct.record`)."""
        direct.record(self.cache, compiled, self.source, self.code_type, self.options, self.target, self.names,
                      self.extra_digest, seconds, mark_no_set=mark_no_set)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Job:
    """One missed compile by its key, and the flight's three verbs."""

    request: _Request
    compiled: CompileKey

    @property
    def size(self) -> int:
        """What the flight predicts the compile's time by: the source, and the headers it reads."""
        return compile_size(len(self.request.source), len(self.compiled.headers))

    def find(self, shared_only: bool = False) -> tuple[ObjectCode, _Entry] | None:
        """The entry, once the flight gave this caller its turn; ``shared_only``: a race's lookup (adopt records it)."""
        found = self.request.find(self.compiled.key, "shared" if shared_only else "all", recheck=not shared_only)
        if found is not None and not shared_only:
            _record_hit(self.request.cache, self.compiled.key)
        return found

    def produce(self, dropped: threading.Event | None = None) -> tuple[ObjectCode, _Entry]:
        """Run the compiler and store what it made (not if ``dropped`` is set by then: a race the lookup won)."""
        return self.store(*self.count(self.request.run_compiler()), dropped)

    def count(self, run: _CompilerRun) -> tuple[ObjectCode, float]:
        """``run``'s output and wall time, counted under this key and handed to the ``on_compile`` hooks (its
        failure too, and raised)."""
        key, code_type, target, tally = self.compiled.key, self.request.code_type, self.request.target, \
            self.request.cache.compile_tally  # fmt: skip
        if run.error is not None:
            compile_times.record(code_type, target, math.nan, 1)  # not a rate, but the compiler's first use is past
            tally.count_compile(run.seconds)
            _record_compile(CompileEvent(key, code_type, target, run.seconds, ok=False))
            raise run.error
        compile_times.note_cpu(code_type, run.seconds, run.cpu_seconds)
        tally.count_compile(run.seconds)
        _record_compile(CompileEvent(key, code_type, target, run.seconds, ok=True))
        assert run.obj is not None
        return run.obj, run.seconds

    def store(self, obj: ObjectCode, seconds: float, dropped: threading.Event | None = None, *,
              mark_no_set: bytes | None = None) -> tuple[ObjectCode, _Entry]:
        """Store what the compiler made (not if ``dropped`` is set: a race the lookup won); the manifests too.

        ``mark_no_set``: a direct key to leave a manifest of no set under where no set can be recorded."""
        request, key = self.request, self.compiled.key
        cache, code_type, target, names = request.cache, request.code_type, request.target, request.names
        compile_times.record(code_type, target, seconds, self.size)  # what the flight plans the next compile with
        _save_times(cache)
        with _counter_lock:
            _remember_saved(cache, key, round(seconds, 6))  # what the manifest records
        entry = _Entry.of(obj, names)
        if dropped is not None and dropped.is_set():
            return obj, entry  # the lookup won the race: the entry is stored already
        # The symbol map before the binary (whoever sees the binary can name its kernels), the binary before its
        # manifest (the upload others wait for goes first: one round trip sooner). Each put carries the compile
        # time, so the chain admits by it (``min_upload_compile_s``); the chain's put never raises.
        if names:
            cache.put(symbols_key(key), encode_symbols(entry.mapping or {}), compile_seconds=seconds)
        cache.put(key, entry.data, compile_seconds=seconds)
        try:  # a manifest that cannot be made (a bug in building it) costs nothing but itself
            inputs = compile_inputs(self.compiled, request.source, code_type, request.options, target, names,
                                    request.extra_digest)  # fmt: skip
            cache.put(manifest_key(key), encode_manifest(build_manifest(key, inputs, seconds)), compile_seconds=seconds)
        except Exception as exc:
            logger.warning("could not store the manifest of entry %s: %r", key[:8].hex(), exc)
        request.record_set(self.compiled, seconds, mark_no_set=mark_no_set)
        return obj, entry

    def adopt(self, entry: _Entry, found: bool = False) -> ObjectCode:
        """Another thread's entry as this one's result; ``found``: it came from a race's lookup (a hit)."""
        if found:
            _record_hit(self.request.cache, self.compiled.key)
        return self.request.wrap(entry)


class _Declined(BaseException):
    """A flight by direct key found that its compile cannot be keyed (``CompileKey.declined``): compiled uncached.

    A BaseException, as an interrupt is: a lease held is released (not failed), and the caller compiles.
    """

    def __init__(self, job: _Job) -> None:
        super().__init__(job.compiled.declined)
        self.job = job


class _Unscanned:
    """A miss no node recorded the headers of, flown by its direct key: its scan runs beside the compile or the wait.

    The first ``find`` starts the scan on a thread of its own. A waiter's later looks ask for the
    entry by the scan's key once it is done (as soon as the holder's upload lands), until then for
    a header set another node recorded (else, where a manifest came that names no set holding here,
    the scan's key); ``produce`` compiles on the caller's thread while the scan runs, then stores
    under the scan's key and records the set.
    """

    def __init__(self, request: _Request, unscanned: direct.Unscanned, scan: Callable[[], CompileKey | None]) -> None:
        self.request, self.unscanned, self._scan = request, unscanned, scan
        self._scanning: concurrent.futures.Future[CompileKey | None] | None = None  # the scan, once started
        self._job: _Job | None = None  # once scanned (or matched): the compile by its key
        self._scanned: CompileKey | None = None  # the key this call's scan gave (not memoized meanwhile)
        self._looked = False  # an entry's lookup was counted for this call
        self._asked = False  # the direct manifest was asked for once (the first look)

    def inputs(self) -> str:
        """The header digest this compile reads (``run_once``'s ``inputs``): the scan's."""
        digest = self.job().compiled.header_digest
        return "" if digest is None else digest.hex()

    def _start_scan(self) -> concurrent.futures.Future[CompileKey | None]:
        """This call's scan, started on a thread of its own the first time it is asked for (once per call)."""
        if self._scanning is None:
            self._scanning = concurrent.futures.Future()
            threading.Thread(target=settle, args=(self._scanning, self._scan), name="tiered-progcache-scan",
                             daemon=True).start()
        return self._scanning

    def job(self, compiled: CompileKey | None = None) -> _Job:
        """The compile by its key: ``compiled``, else the scan's (waited for; its exception is the caller's)."""
        if self._job is None:
            if compiled is None:
                compiled = self._scanned = self._start_scan().result()
                assert compiled is not None  # not memo_only: the scan answers
            self._job = _Job(self.request, compiled)
        return self._job

    def remember_scan(self) -> None:
        """Memoize the scan this call ran, once its flight is over: while the compile was under way, a caller
        arriving on this node found no memo, so it joined this flight rather than flying by the scan's key."""
        basis = None if self._scanned is None else self._scanned.basis
        if basis is not None and not any(is_racy(sig) for _, sig in basis.result.checks):
            adopt_scan(self.request.source, self.request.options, basis.by_role, basis.result, self.unscanned.memo_dir)

    def find(self, shared_only: bool = False) -> tuple[ObjectCode, _Entry] | None:
        """The entry of a set recorded since (or, with a manifest of no set holding here, the scan's key's, the scan
        waited for); from the second look on (a waiter's polls), by the scan's key as soon as the scan is done."""
        if self._job is None:
            scanning, first = self._start_scan(), not self._asked
            self._asked = True
            if first or not scanning.done() or scanning.exception() is not None:  # (the holder's look is a first)
                r, u = self.request, self.unscanned
                sets = direct.read_sets(r.cache, u.storage)
                if sets is None:
                    return None  # nothing recorded yet: the holder is still at it
                self.job(direct.match(sets, r.source, r.code_type, r.options, r.target, r.names, r.extra_digest,
                                      u.by_role, u.cwd, memo_dir=u.memo_dir))
        return self._look()

    def _look(self) -> tuple[ObjectCode, _Entry] | None:
        job = self.job()
        if job.compiled.declined is not None:
            raise _Declined(job)
        if self._looked:
            return job.find()
        self._looked = True  # the call's one counted lookup
        found = self.request.find(job.compiled.key)
        if found is not None:
            _record_hit(self.request.cache, job.compiled.key)
        return found

    def produce(self, dropped: threading.Event | None = None) -> tuple[ObjectCode, _Entry]:
        """The compiler on this thread and, on the first turn, the scan beside it on another; the entry stored under
        the scan's key unless it is there already. (The compiler runs on the caller's thread: NVRTC ran up to
        half again as long on a thread of its own on the H200 host, docs/performance.md.)"""
        run = None
        if self._job is None:  # the first turn: nobody recorded a set, so nobody compiled this before
            self._start_scan()  # (begun by the look under the lease, as a rule)
            run = self.request.run_compiler()
        job = self.job()  # the scan's exception is the caller's (the compile's outcome is then nobody's)
        if job.compiled.declined is not None:  # (a held lease's later turn raised _Declined in find())
            obj = _compile_declined(job, run)
            direct.record_none(self.request.cache, self.unscanned.storage)  # the next caller scans, compiles uncached
            return obj, _Entry.of(obj, self.request.names)
        if self.request.cache.explain_misses:
            _explain_miss(job)
        found = self._look()
        if found is not None:  # stored under this key by a compile that recorded no set here: record it now
            if run is not None:
                with contextlib.suppress(BaseException):  # counted; its failure is nobody's (the entry was there)
                    job.count(run)
            self.request.record_set(job.compiled)
            return found
        obj, seconds = job.count(self.request.run_compiler() if run is None else run)
        # Never dropped (this flight never races); with no set to record, the next caller scans at once.
        return job.store(obj, seconds, mark_no_set=self.unscanned.storage)

    def adopt(self, entry: _Entry, found: bool = False) -> ObjectCode:
        """Another thread's entry as this one's result (this flight never races, so never ``found``)."""
        return self.request.wrap(entry)


def _save_times(cache: TieredProgramCache) -> None:
    """Keep this node's compile rates and its store's round trip in its local directory for its next process."""
    local, shared = cache.local_store, cache.shared_store
    if local is None:
        return
    if shared is not None:
        compile_times.note_round_trip(shared.location, shared.round_trip_s)
    try:
        compile_times.save(local.root)
    except OSError as exc:
        logger.debug("could not save compile times in %s: %r", local.root, exc)


def _explain_miss(job: _Job) -> None:
    """One INFO line saying why this compile missed (``explain_misses``); never raises: it must not cost the compile."""
    r = job.request
    try:
        report = explain_key(job.compiled, r.source, r.code_type, r.options, r.target, r.cache, r.names, r.extra_digest)
    except Exception as exc:
        log_requested(logger, logging.INFO, "miss %s: could not explain it: %r", job.compiled.key[:8].hex(), exc)
        return
    log_requested(logger, logging.INFO, "%s", report.one_line())  # on stderr if the application set up no logging
